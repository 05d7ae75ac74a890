"""Structured output: grammar-constrained decoding, reasoning (thinking) budgets.

Modules, each with one owner:
- params: `StructuredOutputsParams`, what a request asks for (stdlib only);
- reasoning: reasoning parsers (<think>...</think>): token ids, thinking state, budgets;
- compiler: grammar compilation (xgrammar) on a thread pool, cached by (kind, spec);
- grammar_state: one request's matcher, with accept_tokens / rollback / bitmask rows;
- manager: the engine's per-request constraints, the step's bitmasks, metrics.

Nothing here imports xgrammar at import time: an engine whose requests ask for no
grammar never loads it (the offline GPU path runs without it installed).
"""
