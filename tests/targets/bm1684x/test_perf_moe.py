"""The bm1684x performance model on a mixture-of-experts model: decode streams only the chosen experts' weights.

Qwen3-30B-A3B's config.json (tests/data/configs/qwen3-30b-a3b.json, from the published model card): 48 layers,
hidden 2048, 32 query / 4 KV heads of 128, 128 experts of intermediate 768, 8 per token, vocab 151936."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from data_paths import CONFIGS

from topq.core import cli
from topq.core.family import find_family
from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.plugins.targets.bm1684x.perf import estimate_function, predict
from topq.plugins.targets.bm1684x.spec import BM1684X

SEQ = 512


def config() -> dict[str, Any]:
    return json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())


def w4_bytes(n: int, k: int) -> float:
    """W4 g64 asymmetric: half a byte per weight, a bf16 scale and a u8 zero point per 64."""
    return n * k / 2 + n * k // 64 * 3


def hand_weight_bytes(experts_read: int) -> float:
    h, heads, kv_heads, d, inter, experts, layers, vocab = 2048, 32, 4, 128, 768, 128, 48, 151936
    attention = w4_bytes(heads * d, h) + 2 * w4_bytes(kv_heads * d, h) + w4_bytes(h, heads * d)
    router = experts * h * 2  # bf16, never quantized
    expert = 2 * w4_bytes(inter, h) + w4_bytes(h, inter)
    return layers * (attention + router + experts_read * expert) + vocab * h * 2  # lm_head bf16


def test_the_config_is_qwen3_30b_a3b() -> None:
    cfg = config()
    spec = find_family(get_plugins().families, cfg).normalize(cfg)
    assert spec.family == "qwen3_moe" and spec.moe is not None
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (48, 2048, 32, 4,
                                                                                                      128)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.intermediate_size, spec.moe.norm_topk_prob) == (
        128, 8, 768, True)
    assert spec.moe.dense_layers == ()


def test_decode_reads_only_the_active_experts() -> None:
    cfg = config()
    spec = find_family(get_plugins().families, cfg).normalize(cfg)
    p = predict(spec, BM1684X, "w4bf16", SEQ)
    active = hand_weight_bytes(8)
    assert p["weight_bytes_per_token"] == active  # 2 133 852 160 bytes
    kv = 2 * 48 * (SEQ + 1) * 32 * 128 * 2  # K/V history, streamed once per query head (the calibration's choice)
    # the rest: activations, norm weights, RoPE rows and DMA alignment
    assert p["bytes_per_token"] == pytest.approx(active + kv, rel=0.01) and p["bytes_per_token"] > active + kv
    assert p["bytes_per_token"] < 0.2 * hand_weight_bytes(128)  # all experts would be ~16 GB per token


def test_prefill_streams_the_experts_its_tokens_choose() -> None:
    """L tokens with top 8 of 128 each touch E·(1 − (1 − 8/E)^L) distinct experts in expectation (uniform
    routing): 8 for one token, ≈ 127.97 for 128."""
    cfg = config()
    spec = replace(find_family(get_plugins().families, cfg).normalize(cfg), num_layers=1)
    family = get_plugins().families.get("qwen3_moe")
    expert = 2 * w4_bytes(768, 2048) + w4_bytes(2048, 768)
    for length in (1, 16, 128):
        module = build_program(spec, family, StageConfig(SEQ, length, prefill_kv=False), shapes=None)
        (row,) = [r for r in estimate_function(module["block_0"], BM1684X, "w4bf16", "w4bf16").rows
                  if r.name == "MoE"]
        active = 128 * (1 - (1 - 8 / 128) ** length)
        router, acts = 128 * 2048 * 2, 2 * length * 2048 * 2
        assert row.bytes == pytest.approx(active * expert + router + acts, rel=1e-3), length


def test_topq_perf_cli_on_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["perf", "--config", str(CONFIGS / "qwen3-30b-a3b.json"), "--chip", "bm1684x", "--quant",
                     "w4bf16", "--seq-length", str(SEQ), "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes_per_token"] == hand_weight_bytes(8)
