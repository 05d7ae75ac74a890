"""benchmarks/decode_variants: a variant's targets parse to (module, attribute, key), are
set, and are put back exactly (a dict entry that did not exist is removed again), and a
bad target fails before any model loads."""

import json

import pytest

from benchmark_modules import BENCHMARKS, load_benchmark

decode_variants = load_benchmark("decode_variants")


def test_targets_parse_to_module_attribute_and_key():
    from pagoda.kernels.gemv.gemv import gemv
    module, attribute, key = decode_variants.parse_target(
        "pagoda.kernels.gemv.gemv.GEMV_CONFIGS[2048,4096,1]")
    assert (module, attribute, key) == (gemv, "GEMV_CONFIGS", (2048, 4096, 1))
    assert decode_variants.parse_target("pagoda.kernels.gemv.gemv.ENV_SWITCH") == \
        (gemv, "ENV_SWITCH", None)
    assert decode_variants.parse_target("pagoda.kernels.gemv.gemv.GEMV_CONFIGS[qkv]")[2] == "qkv"
    with pytest.raises(ValueError, match="names no module"):
        decode_variants.parse_target("GEMV_CONFIGS")


def test_overrides_are_put_back_exactly():
    from pagoda.kernels.moe import fused_moe_decode as dec
    from pagoda.kernels.gemv.gemv import gemv
    narrow, table = dict(dec.NARROW_DOWN_CONFIG), dict(gemv.GEMV_CONFIGS)
    existing = next(iter(gemv.GEMV_CONFIGS))
    overrides = {
        "pagoda.kernels.moe.fused_moe_decode.NARROW_DOWN_CONFIG": {"BLOCK_N": 2},
        "pagoda.kernels.moe.fused_moe_decode.NARROW_DOWN": False,
        f"pagoda.kernels.gemv.gemv.GEMV_CONFIGS[{','.join(map(str, existing))}]": {"BLOCK_N": 1},
        "pagoda.kernels.gemv.gemv.GEMV_CONFIGS[7,7,1]": {"BLOCK_N": 8},
    }
    undo = decode_variants.apply_overrides(overrides)
    assert dec.NARROW_DOWN_CONFIG == {"BLOCK_N": 2} and dec.NARROW_DOWN is False
    assert gemv.GEMV_CONFIGS[existing] == {"BLOCK_N": 1}
    assert gemv.GEMV_CONFIGS[(7, 7, 1)] == {"BLOCK_N": 8}
    decode_variants.undo_overrides(undo)
    assert dec.NARROW_DOWN_CONFIG == narrow and dec.NARROW_DOWN is True
    assert gemv.GEMV_CONFIGS == table


def test_unknown_attribute_is_refused_and_earlier_targets_put_back():
    from pagoda.kernels.moe import fused_moe_decode as dec
    with pytest.raises(ValueError, match="no attribute 'NO_SUCH_TILE'"):
        decode_variants.apply_overrides({"pagoda.kernels.moe.fused_moe_decode.NARROW_DOWN": False,
                                         "pagoda.kernels.gemv.gemv.NO_SUCH_TILE": 1})
    assert dec.NARROW_DOWN is True


def test_shipped_variant_files_name_real_targets():
    """Every variants file under benchmarks/variants applies and undoes cleanly (what
    main() checks before loading a model)."""
    files = sorted((BENCHMARKS / "variants").glob("*.json"))
    assert files
    for path in files:
        for name, overrides in json.loads(path.read_text()).items():
            decode_variants.undo_overrides(decode_variants.apply_overrides(overrides))


def test_runs_each_variant_each_round_on_a_tiny_model(tmp_path):
    """The whole loop on the CPU (no graphs there): two requests decoding together, two
    variants taking turns for two rounds, the attributes back as they were after it."""
    import argparse
    from pagoda.kernels.moe import fused_moe_decode as dec
    narrow = dict(dec.NARROW_DOWN_CONFIG)
    args = argparse.Namespace(preset="tiny-llama", smoke=True, max_model_len=128, batch=2,
                              max_num_batched_tokens=None, quantization=None,
                              kv_cache_dtype="auto", prompt=12, tokens=6, rounds=2)
    variants = {"default": {},
                "narrow": {"pagoda.kernels.moe.fused_moe_decode.NARROW_DOWN_CONFIG": {"BLOCK_N": 2}}}
    rows = decode_variants.run(args, variants)["rows"]
    assert [r["variant"] for r in rows] == ["default", "narrow"]
    assert all(len(r["ms_per_step"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert dec.NARROW_DOWN_CONFIG == narrow
