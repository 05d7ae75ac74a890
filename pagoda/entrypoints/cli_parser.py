"""The argument parser class of the `pagoda` command and its logging set-up.

`PagodaArgumentParser` shows every flag's default in `--help`, and turns an unknown
flag into an error from the subcommand that was typed (its usage line, not the top
level's) with the closest known flag suggested; a usage error is printed as the error
line first, then a one-line usage pointing at --help (not every flag).
`add_log_level_everywhere` lets `--log-level` go before or after any subcommand;
`configure_logging` applies it.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "INFO"
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already speaks of its
    default, or there is none worth saying (None, False, suppressed)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # Identity, not ==: a default of 0 is worth showing (0 == False).
        if (
            "default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or not action.option_strings
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class PagodaArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in --help and "did you mean" for mistyped flags.

    add_subparsers() builds subcommand parsers of the parser's own class, so every
    level (`pagoda bench serve` too) behaves the same.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        # A parser with subcommands passes what it did not know on to its caller: the
        # leaf subcommand already judged its own leftovers (below), so only a leaf, or
        # the top level, reports them, naming its own usage.
        if extras and (self._subparsers is None or not _is_nested(self)):
            self.error(self._unknown_message(extras))
        return ns, extras

    def error(self, message: str):
        """The error (with its "did you mean" hint) first, then a one-line usage that
        points at --help, rather than argparse's usage listing every flag."""
        self.exit(2, f"{self.prog}: error: {message}\n{self.short_usage()}\n")

    def short_usage(self) -> str:
        """`usage: PROG [options] POSITIONALS (PROG --help lists the options)`, one line."""
        formatter = self._get_formatter()
        positionals = [a for a in self._actions if not a.option_strings]
        formatter.add_usage(None, positionals, [], prefix="")
        words = formatter.format_help().split()[len(self.prog.split()) :]
        return " ".join(
            ["usage:", self.prog, "[options]", *words, f"({self.prog} --help lists the options)"]
        )

    def _unknown_message(self, extras: list[str]) -> str:
        message = f"unrecognized arguments: {' '.join(extras)}"
        flag = next((e for e in extras if e.startswith("-")), None)
        if flag is not None:
            known = [s for s in self._option_string_actions if s.startswith("--")]
            close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]}?"
        return message


def _is_nested(parser: argparse.ArgumentParser) -> bool:
    return getattr(parser, "_pagoda_nested", False)


def add_log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--log-level` on the top level (holding the default) and on every subcommand at
    any depth; the subcommands' copies default to SUPPRESS, so a value given before the
    subcommand is not overwritten by theirs."""
    parser.add_argument(
        "--log-level",
        default=DEFAULT_LOG_LEVEL,
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level of Pagoda's messages",
    )
    for sub in _subcommand_parsers(parser):
        sub._pagoda_nested = True
        if "--log-level" not in sub._option_string_actions:
            sub.add_argument(
                "--log-level",
                default=argparse.SUPPRESS,
                type=str.upper,
                choices=LOG_LEVELS,
                help=f"logging level of Pagoda's messages (default {DEFAULT_LOG_LEVEL})",
            )


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                found.append(sub)
                found.extend(_subcommand_parsers(sub))
    return found


def configure_logging(level: str) -> None:
    """Pagoda's loggers at `level` on stderr; other libraries stay at WARNING unless
    DEBUG is asked for (their INFO chatter is not Pagoda's to print)."""
    logging.basicConfig(
        level=logging.DEBUG if level == "DEBUG" else logging.WARNING,
        format=LOG_FORMAT,
        datefmt=LOG_DATE_FORMAT,
        stream=sys.stderr,
    )
    logging.getLogger("pagoda").setLevel(level)
