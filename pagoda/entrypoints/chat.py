"""`pagoda chat`: an interactive REPL that streams each reply token by token.

Ctrl-C while a reply streams stops that reply (its request is aborted, so its KV
blocks go back to the pool) and keeps the conversation, the partial reply included,
as the user saw it; Ctrl-C (or Ctrl-D) at the prompt exits. While a reply streams,
SIGINT only sets a flag that is checked between engine steps: a KeyboardInterrupt
raised in the middle of a step could leave the scheduler and the worker disagreeing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from pagoda.model.tokenizer import apply_chat_template

BANNER = "pagoda chat: type a message; /reset clears the history, /exit or Ctrl-D quits."
STOPPED = "[reply stopped; the conversation is kept]"


class _InterruptFlag:
    """Within `with`, SIGINT sets `.raised` instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def __enter__(self) -> _InterruptFlag:
        if threading.current_thread() is threading.main_thread():  # signals need it
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def stream_reply(llm, token_ids: list[int], params) -> tuple[str, bool]:
    """Prints the reply as it streams; returns (text so far, whether Ctrl-C stopped it)."""
    pieces: list[str] = []
    with (
        _InterruptFlag() as interrupt,
        contextlib.closing(llm.stream({"prompt_token_ids": token_ids}, params)) as outputs,
    ):
        # Closing the stream (also on an early break) aborts the request in the engine.
        for out in outputs:
            piece = out.outputs[0].text
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
            if interrupt.raised:
                break
    return "".join(pieces), interrupt.raised


def run_chat(llm, params, system: str | None) -> int:
    """The REPL loop; returns the exit status."""
    tokenizer = llm.get_tokenizer()
    template = llm.llm_engine.config.model.chat_template
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print(BANNER)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = history[:1] if system else []
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        ids = apply_chat_template(tokenizer, history, True, template)
        reply, stopped = stream_reply(llm, ids, params)
        sys.stdout.write("\n")
        if stopped:
            print(STOPPED)
        history.append({"role": "assistant", "content": reply})
