"""`pagoda serve --quantization gguf` (the embedded SmolLM2 with its Q4_1/Q8_0 blocks
kept): greedy completions through the server agree with the float32 model offline."""

from __future__ import annotations

import httpx
from helpers.server_harness import launch_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
TOKENS = 16
# Measured: 4 of 4 identical offline (tests/model/test_quant_gguf.py); one prompt may drift.
MIN_IDENTICAL = 3


def test_gguf_blocks_through_the_server_agree_with_float32():
    from pagoda import LLM, SamplingParams

    reference = LLM(max_model_len=256, quantization="none").generate(
        PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
    )
    server = launch_server(
        "--quantization",
        "gguf",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "40",
        "--disable-uvicorn-access-log",
    )
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            texts = []
            for prompt in PROMPTS:
                r = http.post(
                    "/v1/completions",
                    json={
                        "model": http.get("/v1/models").json()["data"][0]["id"],
                        "prompt": prompt,
                        "max_tokens": TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
    finally:
        assert server.stop() == 0
    identical = sum(text == ref.outputs[0].text for text, ref in zip(texts, reference))
    assert identical >= MIN_IDENTICAL, list(zip(texts, [r.outputs[0].text for r in reference]))
