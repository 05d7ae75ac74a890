"""Anthropic's Messages API (`POST /v1/messages`) on the OpenAI server's app and engine.

protocol.py: the request model; translate.py: a Messages request as a chat request,
so rendering, tools, grammars, reasoning and admission are the chat pipeline's;
blocks.py: one choice's output as content blocks and stream events; serving.py: the
route; errors.py: errors in Anthropic's shape on that route.
"""
