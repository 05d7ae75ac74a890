"""The `pagoda` command: generate, chat, serve, bench.

Usage errors name the subcommand's usage (cli_parser.py); errors a user can fix
(a bad model path, a prompt too long, no GPU) end in one `error: ...` line and exit
status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import pagoda
from pagoda.entrypoints.cli_args import (
    TEXT_COMMANDS,
    add_engine_args,
    add_sampling_args,
    cli_error_message,
    engine_args_from_namespace,
    resolve_text_tokenizer,
    sampling_params_from_namespace,
)
from pagoda.entrypoints.cli_parser import (
    PagodaArgumentParser,
    add_log_level_everywhere,
    configure_logging,
)


def _make_llm(ns):
    from pagoda.entrypoints.llm import LLM  # per command: start-up time

    args = engine_args_from_namespace(ns)
    return LLM(**vars(args))


def cmd_generate(ns) -> int:
    llm = _make_llm(ns)
    params = sampling_params_from_namespace(ns)
    for prompt in ns.prompts:  # all checked before any output, as the server would
        check_context(llm.llm_engine, prompt, params.max_tokens)
    for prompt in ns.prompts:
        if ns.stream:
            sys.stdout.write(prompt)
            for out in llm.stream(prompt, params):
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            print(prompt + out.outputs[0].text)
    return 0


def check_context(engine, prompt, max_tokens) -> None:
    """The server's rule (serving_common.check_room): prompt + --max-tokens must fit
    the context, rather than silently stopping at max_model_len."""
    _, token_ids = engine.tokenize_prompt(prompt)
    limit = engine.max_model_len
    if max_tokens is not None and len(token_ids) + max_tokens > limit:
        raise ValueError(
            f"this model's maximum context length is {limit} tokens, but "
            f"{len(token_ids) + max_tokens} were requested ({len(token_ids)} in the prompt, "
            f"{max_tokens} for the completion): shorten the prompt or lower --max-tokens"
        )


def cmd_chat(ns) -> int:
    """An interactive REPL that streams the reply token by token (entrypoints/chat.py)."""
    from pagoda.entrypoints.chat import run_chat  # per command: start-up time

    llm = _make_llm(ns)
    return run_chat(llm, sampling_params_from_namespace(ns), ns.system)


def build_parser() -> argparse.ArgumentParser:
    parser = PagodaArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    parser.add_argument("--version", action="version", version=f"pagoda {pagoda.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts given on the command line")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat that streams replies")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    # The server stack (fastapi, uvicorn, pydantic) is optional on GPU machines: check for
    # it by name, so that a real import error inside Pagoda's server code still surfaces.
    if importlib.util.find_spec("fastapi") is not None:
        from pagoda.entrypoints.openai.cli import add_serve_parser  # per command: start-up time

        add_serve_parser(sub)

    from pagoda.bench.cli import add_bench_subparsers  # imports no server stack

    add_bench_subparsers(sub)
    add_log_level_everywhere(parser)  # last: it walks every subcommand added above
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging(ns.log_level)
    try:
        if ns.command in TEXT_COMMANDS:
            resolve_text_tokenizer(ns)  # before loading: a missing tokenizer fails at once
        return int(ns.func(ns) or 0)
    except ValueError as exc:
        print(f"error: {cli_error_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: no traceback
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
