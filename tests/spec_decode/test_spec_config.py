"""SpeculativeConfig: vLLM's JSON keys, defaults, and every refusal with its message;
`--speculative-config` on the CLI and `speculative_config=` in EngineArgs / LLM."""

from __future__ import annotations

import pytest

from pagoda.config import EngineArgs, SpeculativeConfig
from pagoda.entrypoints import cli
from pagoda.entrypoints.cli_args import engine_args_from_namespace


def test_ngram_defaults_and_vllm_spellings():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)
    assert spec.adaptive is True and spec.compute_bound_tokens is None
    # One bound given: the other follows it; vLLM's old "[ngram]" model spelling.
    only_max = SpeculativeConfig.from_dict(
        {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 1}
    )
    assert (only_max.method, only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (
        "ngram",
        1,
        1,
    )
    only_min = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}
    )
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (7, 7)
    layer_skip = SpeculativeConfig.from_dict(
        {"method": "layer_skip", "num_layers": 4, "num_speculative_tokens": 2, "adaptive": False}
    )
    assert (layer_skip.num_layers, layer_skip.adaptive) == (4, False)
    draft = SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 5})
    assert (draft.method, draft.model) == ("draft_model", "/some/dir")


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer >= 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": -2},
            "num_speculative_tokens must be an integer >= 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2.5},
            "num_speculative_tokens must be an integer >= 1",
        ),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        (
            {"method": "eagle", "num_speculative_tokens": 2},
            "method must be one of ngram, layer_skip, draft_model",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "typo": 1},
            "unknown speculative_config key(s): typo",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "1 <= prompt_lookup_min <= prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be an integer >= 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_layers": 3},
            "'num_layers' belongs to method 'layer_skip', not 'ngram'",
        ),
        ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs num_layers"),
        (
            {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 0},
            "num_layers must be an integer >= 1",
        ),
        (
            {
                "method": "layer_skip",
                "num_speculative_tokens": 2,
                "num_layers": 2,
                "prompt_lookup_max": 3,
            },
            "'prompt_lookup_max' belongs to method 'ngram'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (
            {"model": "x", "num_speculative_tokens": 2, "draft_confidence_threshold": 1.5},
            "draft_confidence_threshold must be a number in [0, 1)",
        ),
        (
            {
                "method": "layer_skip",
                "num_speculative_tokens": 2,
                "num_layers": 2,
                "draft_confidence_threshold": -0.1,
            },
            "draft_confidence_threshold must be a number in",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 2,
                "draft_confidence_threshold": 0.5,
            },
            "'draft_confidence_threshold' belongs to method",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"},
            "adaptive must be true or false",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "compute_bound_tokens": 0},
            "compute_bound_tokens must be an integer >= 1",
        ),
    ],
)
def test_refused_with_a_clear_message(values, message):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_dict(values)
    assert message in str(err.value)


def test_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_dict('{"method": "ngram"}')


def test_layer_skip_needs_fewer_layers_than_the_target():
    spec = SpeculativeConfig.from_dict(
        {"method": "layer_skip", "num_layers": 30, "num_speculative_tokens": 2}
    )
    spec.check_target(31)
    with pytest.raises(ValueError, match=r"num_layers \(30\) must be smaller than the target's 30"):
        spec.check_target(30)


def test_engine_args_build_the_config():
    config = EngineArgs(
        device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 4}
    ).create_engine_config()
    assert config.speculative == SpeculativeConfig("ngram", 4, 2, 5)
    assert EngineArgs(device="cpu").create_engine_config().speculative is None
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        EngineArgs(device="cpu", speculative_config={"k": 1}).create_engine_config()


def test_cli_flag_parses_json():
    ns = cli.build_parser().parse_args(
        [
            "generate",
            "hi",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
        ]
    )
    args = engine_args_from_namespace(ns)
    assert args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    assert cli.build_parser().parse_args(["serve"]).speculative_config is None


@pytest.mark.parametrize(
    "text, message", [("{method: ngram}", "not valid JSON"), ("[1, 2]", "expected a JSON object")]
)
def test_cli_flag_refuses_bad_json(capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "--speculative-config", text])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_planner_set_up_per_method():
    from pagoda.spec_decode.engine_setup import build_draft_planner

    assert build_draft_planner(None, "cpu", 128, 30) == (None, 0)
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    planner, lookahead = build_draft_planner(ngram, "cpu", 128, 30)
    assert lookahead == 0 and planner.host_proposer is not None
    assert (planner.budget.max_k, planner.budget.compute_bound_tokens) == (4, 16)
    assert planner.budget.choose(["new"], 1) == {"new": 3}  # alpha 1/2: gains .5, .25, .125
    assert not planner.budget.drafting_holds  # told by the engine: drafting holds a step
    planner, _ = build_draft_planner(ngram, "cpu", 128, 30, async_scheduling=True)
    assert planner.budget.hold_cost(2) == pytest.approx(2 * (0.2 + 0.8 / 63))
    # 0.875 each covers the held step; told the step runs 4 requests, 0.875 < 4 x .238.
    assert planner.budget.choose(["a", "b"], 2) == {"a": 3, "b": 3}
    assert planner.budget.choose(["c"], 2, num_running=4) == {"c": 0}
    # A layer-skip draft costs num_layers / layers of a forward: at 29 of 30 layers no
    # draft can pay for itself, so the adaptive budget never drafts.
    deep = SpeculativeConfig.from_dict(
        {
            "method": "layer_skip",
            "num_layers": 29,
            "num_speculative_tokens": 2,
            "compute_bound_tokens": 64,
        }
    )
    planner, lookahead = build_draft_planner(deep, "cuda", 128, 30)
    assert lookahead == 2 and planner.host_proposer is None
    assert planner.budget.min_gain == pytest.approx(0.1 + 29 / 30)
    # Async, a worker drafter's requests are scheduled optimistically: nothing is held.
    planner, _ = build_draft_planner(deep, "cuda", 128, 30, async_scheduling=True)
    assert not planner.budget.drafting_holds and planner.budget.hold_cost(64) == 0.0
    assert planner.budget.choose(["new"], 1) == {"new": 0}
    with pytest.raises(ValueError, match="must be smaller than the target's 29 layers"):
        build_draft_planner(deep, "cpu", 128, 29)
    # A draft model costs its weight bytes over the target's per draft.
    draft = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 2})
    planner, lookahead = build_draft_planner(draft, "cpu", 128, 30, 0.125)
    assert lookahead == 2 and planner.host_proposer is None
    assert planner.budget.min_gain == pytest.approx(0.1 + 0.125)
