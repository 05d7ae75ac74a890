"""Models by Hugging Face hub id, resolved offline against a local hub cache.

The cache is built here in huggingface_hub's layout (models--org--name/snapshots/<commit>
and refs/main) with a tiny random Llama and the embedded SmolLM2 tokenizer; every test
runs with HF_HUB_OFFLINE=1 and HF_HOME pointing at it, so nothing touches the network
and the real resolution code (huggingface_hub.snapshot_download) is what runs.
"""

from __future__ import annotations

import pytest
from helpers.tiny_models import save_tiny_hub_repo

from pagoda.config import EngineArgs
from pagoda.model.hub import HubModelError, hub_cache_dir, looks_like_repo_id, resolve_hub_model

REPO = "pagoda-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    snapshot = save_tiny_hub_repo(home / "hub", REPO, COMMIT)
    return home, snapshot


@pytest.fixture
def offline_hub(hf_home, monkeypatch):
    home, snapshot = hf_home
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home, snapshot


def test_repo_id_shape():
    assert looks_like_repo_id("Qwen/Qwen3-0.6B")
    assert looks_like_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    for not_an_id in (
        "llama-3.1-8b",
        "/abs/path",
        "./rel/dir",
        "a/b/c",
        "org/model.gguf",
        "org/",
        "/name",
        "org--x/name",
        "org/na..me",
    ):
        assert not looks_like_repo_id(not_an_id), not_an_id


def test_resolves_to_the_cached_snapshot(offline_hub):
    home, snapshot = offline_hub
    assert hub_cache_dir() == str(home / "hub")
    assert resolve_hub_model(REPO) == str(snapshot)
    assert resolve_hub_model(REPO, revision="main") == str(snapshot)
    assert resolve_hub_model(REPO, revision=COMMIT) == str(snapshot)


def test_paths_and_presets_pass_through(offline_hub, tmp_path):
    assert resolve_hub_model(str(tmp_path)) == str(tmp_path)
    assert resolve_hub_model("tiny-llama") == "tiny-llama"
    with pytest.raises(HubModelError, match="revision 'v2' applies to Hugging Face hub ids only"):
        resolve_hub_model(str(tmp_path), revision="v2")


def test_download_dir_is_the_cache(offline_hub, tmp_path):
    snapshot = save_tiny_hub_repo(tmp_path, "pagoda-test/elsewhere", COMMIT)
    assert resolve_hub_model("pagoda-test/elsewhere", download_dir=str(tmp_path)) == str(snapshot)


def test_uncached_revision_fails_clearly(offline_hub):
    home, _ = offline_hub
    with pytest.raises(HubModelError) as info:
        resolve_hub_model(REPO, revision="v2.0")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"cannot reach the Hugging Face hub and {REPO} (revision v2.0) "
        f"is not in the local cache at {home / 'hub'}; "
    )
    assert "HF_HUB_OFFLINE" in message


def test_uncached_model_fails_in_one_line(offline_hub, capsys):
    home, _ = offline_hub
    from pagoda.entrypoints.cli import main

    code = main(["generate", "hi", "--model", "pagoda-test/not-cached", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith(
        "error: cannot reach the Hugging Face hub and pagoda-test/not-cached "
        f"is not in the local cache at {home / 'hub'}; "
    )


def test_cli_flags_reach_the_model_config():
    from pagoda.entrypoints.cli import build_parser
    from pagoda.entrypoints.cli_args import engine_args_from_namespace

    ns = build_parser().parse_args(
        ["generate", "hi", "--model", REPO, "--revision", "v1", "--download-dir", "/models"]
    )
    config = engine_args_from_namespace(ns).create_engine_config().model
    assert (config.model, config.revision, config.download_dir) == (REPO, "v1", "/models")


def test_llm_generates_from_a_hub_id(offline_hub):
    from pagoda import LLM, SamplingParams

    llm = LLM(
        REPO,
        tokenizer=REPO,
        revision="main",
        device="cpu",
        max_model_len=64,
        kv_cache_memory=1 << 22,
    )
    assert llm.llm_engine.model_path == str(offline_hub[1])
    out = llm.generate(
        ["The capital of France is"],
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 4
    assert isinstance(out.outputs[0].text, str)
    llm.llm_engine.shutdown()


def test_engine_args_name_the_new_fields():
    assert {"revision", "download_dir"} <= EngineArgs.field_names()


def test_a_repo_without_safetensors(offline_hub, tmp_path):
    """Weights are checked by repo name; dummy weights need only config.json."""
    import shutil

    snapshot = tmp_path / "models--pagoda-test--shape-only" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    shutil.copy(offline_hub[1] / "config.json", snapshot)
    (tmp_path / "models--pagoda-test--shape-only" / "refs").mkdir()
    (tmp_path / "models--pagoda-test--shape-only" / "refs" / "main").write_text(COMMIT)
    repo, cache = "pagoda-test/shape-only", str(tmp_path)
    with pytest.raises(HubModelError, match=f"^{repo} has no \\*.safetensors weights"):
        resolve_hub_model(repo, download_dir=cache)
    assert resolve_hub_model(repo, download_dir=cache, use="config") == str(snapshot)
