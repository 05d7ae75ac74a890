"""Engine flags shared by every CLI subcommand (vLLM's names), sampling flags, and the
CLI's spelling of engine errors.

Owns turning EngineFlags' fields (pagoda.engine_flags, where each engine flag is
defined once: name, type, default, help, choices, alias, group) into argparse flags,
the parsed flags back into EngineArgs, checking before anything loads that a command
taking text has a tokenizer (`resolve_text_tokenizer`), and rewriting an engine
error's Python names (`load_format='dummy'`, `max_model_len`) as the flags a CLI user
types (`--load-format dummy`, `--max-model-len`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing

from pagoda.config import EngineArgs, _cuda_available
from pagoda.engine_flags import ENGINE_FLAGS, FLAG_GROUPS, EngineFlags, cli_flag
from pagoda.model.presets import is_preset, preset_tokenizer
from pagoda.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineArgs' fields), in groups by what they set."""
    groups = {title: parser.add_argument_group(title) for title in FLAG_GROUPS}
    hints = typing.get_type_hints(EngineFlags)
    for field in dataclasses.fields(EngineFlags):
        alias = field.metadata["alias"]
        names = (cli_flag(field.name),) + ((alias,) if alias else ())
        groups[field.metadata["group"]].add_argument(
            *names, **_argparse_options(field, hints[field.name])
        )


def _argparse_options(field: dataclasses.Field, annotation) -> dict:
    """add_argument's keywords for one EngineFlags field (see engine_flags.flag)."""
    meta = field.metadata
    options = {"default": field.default, "help": meta["help"]}
    if meta["choices"] is not None:
        options["choices"] = meta["choices"]
    if meta["metavar"] is not None:
        options["metavar"] = meta["metavar"]
    value_type = _value_type(annotation)
    if meta["parse"] is not None:
        options["type"] = _argparse_type(meta["parse"])
    elif value_type is bool:
        options["action"] = (
            "store_true" if field.default is False else argparse.BooleanOptionalAction
        )
    elif value_type is None:
        raise TypeError(
            f"engine flag {field.name} ({annotation}) needs flag(..., parse=...) "
            f"to be read from the command line"
        )
    elif value_type is not str:
        options["type"] = value_type
    return options


def _value_type(annotation):
    """int for int or Optional[int], and so on; None for anything else."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (bool, int, float, str) else None


def _argparse_type(parse):
    """A flag parser whose ValueError argparse prints as "argument --flag: message"."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


# name='value', name="value", name=value or a bare name= (Python's spelling of an argument).
_ASSIGNMENT = re.compile(r"(?<![\w.-])([a-z][a-z0-9_]*)=(?:'([^']*)'|\"([^\"]*)\"|([^\s,;)'\"]*))")


def cli_error_message(exc: BaseException) -> str:
    """An engine error as a CLI user should read it: engine arguments spelled as flags.

    `load_format='dummy'` becomes `--load-format dummy`, `tokenizer=` `--tokenizer`; a
    bare name with an underscore (`max_model_len`), or one the ConfigError names in its
    `fields` (`device`), becomes its flag. Quoted names, paths and dotted names stay.
    """

    def assignment(match: re.Match) -> str:
        name = match.group(1)
        if name not in ENGINE_FLAGS:
            return match.group(0)
        value = next((v for v in match.group(2, 3, 4) if v is not None), "")
        return f"{cli_flag(name)} {value}" if value else cli_flag(name)

    text = _ASSIGNMENT.sub(assignment, str(exc))
    names = {name for name in ENGINE_FLAGS if "_" in name}
    names.update(name for name in getattr(exc, "fields", ()) if name in ENGINE_FLAGS)
    alternatives = "|".join(sorted(names, key=len, reverse=True))
    bare = re.compile(rf"(?<![\w.'\"/-])({alternatives})(?![\w'\"/-])")
    return bare.sub(lambda match: cli_flag(match.group(1)), text)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; a flag the machine cannot honour is a ValueError
    that names the flag to use instead (the CLI prints it as one line)."""
    if getattr(ns, "device", None) == "cuda" and not _cuda_available():
        raise ValueError(
            "--device cuda: no CUDA GPU is available on this machine; "
            "use --device cpu (or leave --device out to pick automatically)"
        )
    chat_template = ns.chat_template
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                chat_template = f.read()
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)}
    values["chat_template"] = chat_template
    return EngineArgs(**values)


# Subcommands that take text: a model without a tokenizer fails them before it loads.
# (The bench commands and token-id clients of `serve --skip-tokenizer-init` need none.)
TEXT_COMMANDS = ("generate", "chat", "serve")


def resolve_text_tokenizer(ns: argparse.Namespace) -> None:
    """Before the engine loads, for a command that takes text (ns.command): a preset
    shape with dummy weights takes the tokenizer that ships for it, if any (sets
    ns.tokenizer), else the command fails with one line naming --tokenizer. Models with
    files bring their own tokenizer; --tokenizer wins; --skip-tokenizer-init serves
    token ids (refused by generate and chat, which take text)."""
    if ns.skip_tokenizer_init:
        if ns.command != "serve":
            raise ValueError(
                f"pagoda {ns.command} takes text, and --skip-tokenizer-init leaves it no "
                f"tokenizer: drop --skip-tokenizer-init"
            )
        return
    model = getattr(ns, "model", None) or getattr(ns, "model_tag", None)
    if (
        model is None
        or ns.tokenizer is not None
        or ns.load_format != "dummy"
        or not is_preset(model)
        or os.path.exists(model)
    ):
        return
    ns.tokenizer = preset_tokenizer(model)
    if ns.tokenizer is None:
        token_ids = ", or --skip-tokenizer-init to serve token ids" if ns.command == "serve" else ""
        raise ValueError(
            f"{model} is a preset shape with random weights and no tokenizer: pass "
            f"--tokenizer (a GGUF file, or a Hugging Face directory or hub id with the "
            f"same vocabulary){token_ids}"
        )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 means off")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def sampling_params_from_namespace(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
