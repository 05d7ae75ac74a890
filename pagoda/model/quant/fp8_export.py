"""Writing an FP8 checkpoint from a float Hugging Face directory, in either format Pagoda
reads: compressed-tensors with per-channel scales (dynamic per-token activations), or
transformers' "fp8" with 128x128 block scales (``weight_scale_inv``, DeepSeek-V3 style).

Used to test and measure FP8 checkpoint loading without network access; also a small
offline tool: ``python -m pagoda.model.quant.fp8_export SRC DST --scheme block``.
Only the decoder layers' projection weights are quantized (the embedding, norms and
LM head stay as they were), as llm-compressor's default recipes do.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagoda.kernels.fp8.quant import quantize_weight_blockwise, quantize_weight_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = ("channel", "block")


def _is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and any(
        name.endswith(f".{p}.weight") for p in PROJECTIONS
    )


def quantization_config(scheme: str) -> dict:
    if scheme == "channel":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {**fp8, "strategy": "channel", "dynamic": False},
                    "input_activations": {**fp8, "strategy": "token", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        }
    if scheme == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    raise ValueError(f"unknown FP8 scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def quantize_tensors(tensors: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        if not _is_projection(name):
            out[name] = tensor
            continue
        stem = name[: -len(".weight")]
        if scheme == "channel":
            weight, scale = quantize_weight_per_channel(tensor)
            out[f"{stem}.weight_scale"] = scale.reshape(-1, 1).float()
        else:
            weight, scale = quantize_weight_blockwise(tensor, (128, 128))
            out[f"{stem}.weight_scale_inv"] = scale.float()
        out[name] = weight
    return out


def export_fp8(src: Path, dst: Path, scheme: str) -> None:
    """Writes dst: src's config.json with a quantization_config, its tokenizer files, and
    one model.safetensors with FP8 projections."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(file, dst / file.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    save_file(quantize_tensors(tensors, scheme), str(dst / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a float Hugging Face directory")
    parser.add_argument("dst", help="the FP8 checkpoint's directory (created)")
    parser.add_argument("--scheme", choices=SCHEMES, default="channel")
    args = parser.parse_args()
    export_fp8(Path(args.src), Path(args.dst), args.scheme)


if __name__ == "__main__":
    main()
