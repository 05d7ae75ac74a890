"""Models by Hugging Face hub id: `org/name` -> a local snapshot directory.

`resolve_hub_model(model, revision, download_dir)` returns `model` unchanged when it is
an existing path, a preset name or anything that is not shaped like a repo id; otherwise
it asks `huggingface_hub.snapshot_download` for the snapshot of that repo at `revision`
in the hub cache (`download_dir`, else `HF_HUB_CACHE`, else `$HF_HOME/hub`). With the
hub reachable the missing files are downloaded (tqdm progress bars on the terminal);
offline (`HF_HUB_OFFLINE=1`) or unreachable, only the cache is used. Either way the
result is a plain local directory that the safetensors loader and the tokenizer read
like any other.

Only the files Pagoda reads are fetched: config, generation config, tokenizer and chat
template files, and the safetensors weights with their index (not .bin, .gguf, .onnx
copies a repo may also carry). Failures become one-line `HubModelError`s (a
ValueError, so the CLI prints them as `error: ...`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pagoda.config import ModelConfig
from pagoda.model.presets import is_preset

logger = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
# What each use of a repo fetches. "config": the shape only (load_format dummy). A
# tokenizer takes config.json too: transformers may read the tokenizer's class there.
FILES_FOR = {
    "model": CONFIG_FILES + TOKENIZER_FILES + WEIGHT_FILES,
    "config": CONFIG_FILES + TOKENIZER_FILES,
    "tokenizer": CONFIG_FILES + TOKENIZER_FILES,
}

# The hub's rule for names (letters, digits, '-', '_', '.'; no '--' or '..'), as one
# `namespace/name` pair: a bare name is a local path or a preset, never a hub id here.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


class HubModelError(ValueError):
    """A hub id that cannot be turned into a local directory; the message is one line."""


def looks_like_repo_id(model: str) -> bool:
    """Whether model is shaped like `org/name` (and names no .gguf file: that is a path)."""
    return (
        _REPO_ID.fullmatch(model) is not None
        and "--" not in model
        and ".." not in model
        and not model.endswith((".gguf", ".json", ".safetensors"))
    )


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where snapshots live: download_dir, else the environment's cache, read now rather
    than at huggingface_hub's import (a test or a caller may set HF_HOME later)."""
    if download_dir:
        return str(Path(download_dir).expanduser())
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants  # hub ids only

    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it."""
    from huggingface_hub import constants  # hub ids only

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def resolve_hub_model(
    model: str, revision: str | None = None, download_dir: str | None = None, use: str = "model"
) -> str:
    """The local directory for model: itself when it is not a hub id, else its snapshot
    holding the files FILES_FOR[use] names ("model", "config" or "tokenizer")."""
    if os.path.exists(model) or not looks_like_repo_id(model):
        if revision is not None:  # never ignore it silently: it would pick other weights
            raise HubModelError(
                f"revision {revision!r} applies to Hugging Face hub ids only, "
                f"and {model!r} is not one"
            )
        return model
    if is_preset(model):
        return model
    cache = hub_cache_dir(download_dir)
    snapshot = _snapshot(model, revision, cache, FILES_FOR[use])
    _check_snapshot(model, revision, Path(snapshot), use)
    logger.info("model %s%s: %s", model, f" ({revision})" if revision else "", snapshot)
    return snapshot


def resolve_model(config: ModelConfig) -> str | None:
    """config.model as a local path, preset name, or None (the embedded model)."""
    if config.model is None:
        if config.revision is not None:
            raise HubModelError("revision applies to Hugging Face hub ids only; no model is given")
        return None
    use = "config" if config.load_format == "dummy" else "model"
    return resolve_hub_model(config.model, config.revision, config.download_dir, use)


def resolve_tokenizer(config: ModelConfig) -> str | None:
    """config.tokenizer as a local path (None: the model's own). A hub id takes the
    model's revision when it names the model's repo, else its default branch."""
    if config.tokenizer is None:
        return None
    revision = config.revision if config.tokenizer == config.model else None
    return resolve_hub_model(config.tokenizer, revision, config.download_dir, "tokenizer")


def _snapshot(repo_id: str, revision: str | None, cache: str, files: tuple[str, ...]) -> str:
    """snapshot_download, its exceptions turned into one clear line each."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download  # hub ids only

    offline = hub_offline()
    what = repo_id if revision is None else f"{repo_id} (revision {revision})"
    logger.info(
        "%s: %s in %s",
        what,
        "cache only (HF_HUB_OFFLINE)" if offline else "looking it up on the Hugging Face hub",
        cache,
    )
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=list(files),
            local_files_only=offline,
        )
    except hub_errors.IncompleteSnapshotError as exc:
        raise HubModelError(
            f"cannot reach the Hugging Face hub and the cached snapshot of {what} "
            f"at {exc.snapshot_path} misses files; download it again with the "
            f"hub reachable"
        ) from None
    except hub_errors.LocalEntryNotFoundError:
        hint = (
            "unset HF_HUB_OFFLINE to download it"
            if offline
            else "check the network (or HF_ENDPOINT)"
        )
        raise HubModelError(
            f"cannot reach the Hugging Face hub and {what} is not in the local cache at {cache}; "
            f"{hint}, or pass --download-dir where it is cached, or a local directory "
            f"(no local path {repo_id!r} exists)"
        ) from None
    except hub_errors.GatedRepoError:
        raise HubModelError(
            f"{repo_id} is gated on the Hugging Face hub: accept its terms on "
            f"huggingface.co and set HF_TOKEN"
        ) from None
    except hub_errors.RevisionNotFoundError:
        raise HubModelError(
            f"{repo_id} has no revision {revision!r} on the Hugging Face hub"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise HubModelError(
            f"no local path {repo_id!r} and no model {repo_id} on the Hugging Face "
            f"hub (a private one needs HF_TOKEN)"
        ) from None
    except hub_errors.HFValidationError as exc:
        raise HubModelError(f"{repo_id!r} is not a valid Hugging Face repo id: {exc}") from None


def _check_snapshot(repo_id: str, revision: str | None, snapshot: Path, use: str) -> None:
    """A snapshot lacking what Pagoda loads gets a message naming the repo, not the
    loader's list of formats about a cache path the user never typed."""
    at = f" at revision {revision}" if revision else ""
    if use != "tokenizer" and not (snapshot / "config.json").is_file():
        raise HubModelError(
            f"{repo_id}{at} has no config.json: not a transformers model "
            f"Pagoda can load ({snapshot})"
        )
    if use == "model" and not any(snapshot.glob("*.safetensors")):
        raise HubModelError(
            f"{repo_id}{at} has no *.safetensors weights (Pagoda loads "
            f"safetensors; load_format='dummy' needs only config.json)"
        )
