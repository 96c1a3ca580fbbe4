"""The bm1684x performance model: calibration against public measurements, sanity, and bookkeeping."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
from data_paths import CONFIGS

from topq.core.errors import TopqError
from topq.core.family import ModelSpec, find_family
from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.plugins.targets.bm1684x.perf import (
    CALIBRATION,
    estimate_function,
    perf_entry,
    predict,
    predict_bundle,
    quant_mode,
)
from topq.plugins.targets.bm1684x.spec import BM1684X, BM1688


def config(name: str) -> dict[str, Any]:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def spec(name: str) -> ModelSpec:
    cfg = config(name)
    return find_family(get_plugins().families, cfg).normalize(cfg)


def w4(name: str, seq: int, chip: Any = BM1684X, **kw: Any) -> dict[str, Any]:
    """The measurement setting: W4BF16 g64, lm_head W4BF16 g64, prefill at the full sequence."""
    return predict(spec(name), chip, "w4bf16", seq, seq, lm_head_quant="w4bf16", group_size=64, **kw)


# ------------------------------------------------------------------------------------------ fixtures' facts


@pytest.mark.parametrize("name, values", [
    ("qwen2.5-7b", (3584, 18944, 28, 28, 4, 128, 152064, False)),
    ("qwen3-4b", (2560, 9728, 36, 32, 8, 128, 151936, True)),
    ("deepseek-r1-distill-qwen-7b", (3584, 18944, 28, 28, 4, 128, 152064, False)),
    ("qwen2.5-1.5b", (1536, 8960, 28, 12, 2, 128, 151936, True)),
])
def test_config_fixtures_hold_the_published_values(name: str, values: tuple[Any, ...]) -> None:
    s = spec(name)
    assert (s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim,
            s.vocab_size, s.tie_word_embeddings) == values


# ------------------------------------------------------------------------------------------ calibration

MEASURED = [  # BM1684X, batch 1, public numbers (docs/perf.md)
    ("qwen2.5-7b", 512, 10.26, 0.652),
    ("qwen3-4b", 512, 15.86, 0.464),
    ("deepseek-r1-distill-qwen-7b", 2048, 8.30, 2.94),
]


@pytest.mark.parametrize("name, seq, tps, ftl", MEASURED)
def test_bm1684x_predictions_within_11_percent(name: str, seq: int, tps: float, ftl: float) -> None:
    p = w4(name, seq)
    assert p["decode_tps"] == pytest.approx(tps, rel=0.11)
    assert p["ftl_s"] == pytest.approx(ftl, rel=0.11)


@pytest.mark.parametrize("name, seq, tps, ftl", [("qwen2.5-1.5b", 1024, 20.17, 1.283), ("qwen3-4b", 512, 7.98, 1.656)])
def test_bm1688_predictions_from_its_spec(name: str, seq: int, tps: float, ftl: float) -> None:
    """Public BM1688 measurements (docs/perf.md), not fitted: the chip's constants come from its spec and TPU-MLIR's
    cycle model, the calibration is the BM1684X one. Reached: decode +4.6 / +9.3 %, first token +5.6 / +11.3 %."""
    p = w4(name, seq, BM1688)
    assert p["decode_tps"] == pytest.approx(tps, rel=0.10)
    assert p["ftl_s"] == pytest.approx(ftl, rel=0.12)


def test_bm1688_prefill_runs_at_its_16_bit_cube_rate() -> None:
    """TPU-MLIR's cycle model (benchmarks/cube_rate.py): BM1688 multiplies 1024 bf16 MACs per cycle and core, a
    quarter of its 4096 int8 ones (BM1684X: half); a prefill block's linears are bound by that rate, not by DMA."""
    assert BM1688.peak_ops["bf16"] == pytest.approx(2 * 1024 * BM1688.clock_hz)
    assert BM1688.peak_ops["int8"] / BM1688.peak_ops["bf16"] == pytest.approx(4)
    assert BM1684X.peak_ops["int8"] / BM1684X.peak_ops["bf16"] == pytest.approx(2)
    m = build_program(spec("qwen3-4b"), get_plugins().families.get("qwen3"), StageConfig(512, 512, False))
    rows = [r for r in estimate_function(m["block_0"], BM1688, "w4bf16").rows if r.name in ("MatMul", "MLP")]
    assert len(rows) == 5  # q, k, v, o and the MLP
    for r in rows:
        cube_s = r.flops / BM1688.cores / (BM1688.peak_ops["bf16"] * CALIBRATION.cube_eff)
        assert r.compute_s == pytest.approx(cube_s, rel=0.05)  # + the W4 dequantisation on the EU
        assert r.compute_s > 3 * r.dma_s


def test_bm1688_cores_share_one_ddr_interface() -> None:
    """A decode step is bound by the DDR interface both cores stream through, not by twice one core's DMA."""
    p = w4("qwen3-4b", 512, BM1688)
    assert p["bytes_per_token"] * p["decode_tps"] <= BM1688.ddr_bandwidth * CALIBRATION.ddr_eff
    assert p["ddr_utilization"] == pytest.approx(CALIBRATION.ddr_eff, rel=0.05)


def test_the_constants_are_physical() -> None:
    c = CALIBRATION
    for eff in (c.cube_eff, c.attn_eff, c.vector_eff, c.ddr_eff):
        assert 0.0 < eff <= 1.0
    assert c.attn_eff <= c.cube_eff  # fused attention never beats a plain matmul
    assert c.group_overhead_s > 0 and c.launch_s > 0


# ------------------------------------------------------------------------------------------ sanity


def test_longer_context_decodes_slower() -> None:
    p = w4("qwen3-4b", 4096)
    by_context = {int(k): v for k, v in p["decode_tps_by_context"].items()}
    assert sorted(by_context) == [512, 1024, 2048, 4096]
    tps = [by_context[c] for c in sorted(by_context)]
    assert all(a > b for a, b in pairwise(tps)), tps
    assert p["decode_tps"] == pytest.approx(by_context[4096])
    sizes = [p["bytes_per_token_by_context"][str(c)] for c in sorted(by_context)]
    assert all(a < b for a, b in pairwise(sizes))


def test_w4_decodes_faster_than_w8_than_bf16() -> None:
    s = spec("qwen2.5-7b")
    tps = {q: predict(s, BM1684X, q, 512, 512, lm_head_quant=q)["decode_tps"] for q in ("w4bf16", "w8bf16", "bf16")}
    assert tps["w4bf16"] > tps["w8bf16"] > tps["bf16"]
    assert tps["w4bf16"] / tps["bf16"] > 2.5  # ~3.5x fewer bytes per token


def test_longer_prefill_takes_longer() -> None:
    s = spec("qwen3-4b")
    short, long = (predict(s, BM1684X, "w4bf16", 2048, n)["ftl_s"] for n in (512, 2048))
    assert long > 3.5 * short  # more than linear: attention grows with the square


def test_bm1688_is_slower_than_bm1684x() -> None:
    x, y = w4("qwen3-4b", 512, BM1684X), w4("qwen3-4b", 512, BM1688)
    assert y["decode_tps"] < x["decode_tps"]
    assert y["ftl_s"] > x["ftl_s"]
    assert y["cores"] == 2


def test_bm1688_splits_a_matmul_across_its_cores() -> None:
    """Each core streams half of the weight; the two cores share one DDR interface, which bounds the time."""
    m = build_program(spec("qwen3-4b"), get_plugins().families.get("qwen3"), StageConfig(512, 512, False))
    mode = quant_mode("w4bf16")
    (row,) = [r for r in estimate_function(m["lm_head"], BM1688, mode, "w4bf16").rows if r.name == "MatMul"]
    weight = mode.weight_bytes(151936, 2560)
    per_core_s = weight / (BM1688.ddr_bandwidth * CALIBRATION.ddr_eff)  # both halves through one interface
    assert row.dma_s == pytest.approx(per_core_s, rel=0.01)
    assert row.bytes == pytest.approx(weight, rel=0.01)


# ------------------------------------------------------------------------------------------ bookkeeping


def test_weight_storage_sizes() -> None:
    n, k = 1024, 4096
    assert quant_mode("bf16").weight_bytes(n, k) == 2 * n * k
    assert quant_mode("w8bf16").weight_bytes(n, k) == n * k + n * k / 64 * 3
    assert quant_mode("w4bf16").weight_bytes(n, k) == n * k / 2 + n * k / 64 * 3  # bf16 scale + u8 zero
    assert quant_mode("w4bf16", symmetric=True).weight_bytes(n, k) == n * k / 2 + n * k / 64 * 2
    assert quant_mode("w4bf16", group_size=128).weight_bytes(n, k) == n * k / 2 + n * k / 128 * 3
    assert quant_mode("w4bf16", group_size=-1).weight_bytes(n, k) == n * k / 2 + n * 3
    with pytest.raises(TopqError, match="known: .*w4bf16"):
        quant_mode("w3bf16")


def _independent_decode_bytes(s: ModelSpec, history: int, kv_heads_read: int) -> float:
    """Weights (W4 g64 asymmetric, lm_head too) + K/V history, computed from the config by hand."""
    def w4_bytes(n: int, k: int) -> float:
        return n * k * 0.5 + (n * k // 64) * (2 + 1)

    h, d, inter = s.hidden_size, s.head_dim, s.intermediate_size
    layer = (w4_bytes(s.num_heads * d, h) + 2 * w4_bytes(s.num_kv_heads * d, h) + w4_bytes(h, s.num_heads * d)
             + 3 * w4_bytes(inter, h))
    kv = 2 * s.num_layers * (history + 1) * kv_heads_read * d * 2
    return s.num_layers * layer + w4_bytes(s.vocab_size, h) + kv


@pytest.mark.parametrize("name, seq", [("qwen2.5-7b", 512), ("qwen3-4b", 2048)])
@pytest.mark.parametrize("per_query_head", [True, False])
def test_bytes_per_token_is_weights_plus_kv(name: str, seq: int, per_query_head: bool) -> None:
    s = spec(name)
    cal = replace(CALIBRATION, kv_per_query_head=per_query_head)
    p = w4(name, seq, cal=cal)
    heads = s.num_heads if per_query_head else s.num_kv_heads
    expected = _independent_decode_bytes(s, seq, heads)
    # the rest is activations, norm weights, biases, RoPE rows and DMA alignment: well under 1 %
    assert p["bytes_per_token"] == pytest.approx(expected, rel=0.01)
    assert p["bytes_per_token"] > expected


@pytest.mark.parametrize("function", ["block_0", "block_cache_0", "lm_head", "embedding"])
def test_per_op_rows_sum_to_the_function_total(function: str) -> None:
    m = build_program(spec("qwen2.5-7b"), get_plugins().families.get("qwen2"), StageConfig(512, 512, False))
    est = estimate_function(m[function], BM1684X, "w4bf16", "w4bf16")
    assert est.total_s == pytest.approx(sum(r.time_s for r in est.rows) + est.launch_s, rel=1e-12)
    assert all(r.time_s >= 0 and r.compute_s >= 0 and r.dma_s >= 0 for r in est.rows)
    # a group never takes less than its compute or its DMA, and overlaps them (not their sum)
    for g in range(est.groups):
        rows = [r for r in est.rows if r.group == g]
        compute, dma, time = (sum(getattr(r, f) for r in rows) for f in ("compute_s", "dma_s", "time_s"))
        assert time == pytest.approx(max(compute, dma) + CALIBRATION.group_overhead_s, rel=1e-9)
    assert est.table().count("\n") == len(est.rows) + 1


def test_layer_groups_one_per_weight_op() -> None:
    m = build_program(spec("qwen3-4b"), get_plugins().families.get("qwen3"), StageConfig(512, 512, False))
    est = estimate_function(m["block_cache_0"], BM1684X, "w4bf16")
    anchors = [r for r in est.rows if r.name in ("MatMul", "MLP", "FAttention")]
    assert est.groups == len(anchors) == 6  # q, k, v, attention, o, mlp
    assert {r.group for r in anchors} == set(range(6))
    norm = next(r for r in est.rows if r.loc == "layers.0.input_layernorm")
    assert norm.group == next(r.group for r in est.rows if r.loc == "layers.0.q_proj")


def test_decode_is_bandwidth_bound_and_prefill_compute_bound() -> None:
    m = build_program(spec("qwen2.5-7b"), get_plugins().families.get("qwen2"), StageConfig(512, 512, False))
    decode = estimate_function(m["block_cache_0"], BM1684X, "w4bf16")
    prefill = estimate_function(m["block_0"], BM1684X, "w4bf16")
    assert decode.dma_s > 3 * decode.compute_s
    assert prefill.compute_s > 3 * prefill.dma_s
    mlp = next(r for r in prefill.rows if r.name == "MLP")
    assert mlp.flops == 2 * 512 * 3 * 3584 * 18944


# ------------------------------------------------------------------------------------------ entry point


def test_perf_entry_from_a_config() -> None:
    perf = perf_entry(BM1684X)
    result = perf(config=config("qwen3-4b"), quant="w4bf16", seq_length=512, max_input_length=512,
                  lm_head_quant="w4bf16", group_size=64)
    direct = w4("qwen3-4b", 512)
    for key in ("ftl_s", "decode_tps", "bytes_per_token"):
        assert result[key] == pytest.approx(direct[key], rel=1e-12)
    json.dumps(result)  # the CLI prints it as JSON
    for key in ("ftl_s", "decode_tps", "bytes_per_token"):
        assert isinstance(result[key], float) and result[key] > 0


def test_perf_entry_auto_reads_the_checkpoint_quantization() -> None:
    cfg = {**config("qwen3-4b"), "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    perf = perf_entry(BM1684X)
    auto = perf(config=cfg, quant="auto", seq_length=512)
    assert auto["quant"] == "w4bf16" and auto["group_size"] == 128
    plain = perf(config=config("qwen3-4b"), quant="auto", seq_length=512)
    assert plain["quant"] == "bf16"


def test_perf_entry_rejects_an_unknown_mode() -> None:
    with pytest.raises(TopqError, match="unknown quant mode"):
        perf_entry(BM1684X)(config=config("qwen3-4b"), quant="w2bf16", seq_length=512)


def _fake_bundle(s: ModelSpec, **stages: Any) -> Any:
    meta = {"stages": {"seq_length": 1024, "max_input_length": 256, "prefill_kv": True,
                       "decode_variants": [256, 512, 1024], **stages},
            "scheme": "w4bf16", "family": s.family}
    return SimpleNamespace(spec=s, meta=meta, recipe={"quant": {"scheme": "w4bf16", "group_size": 64,
                                                                 "symmetric": False, "lm_head": "bf16"}})


def test_perf_entry_for_a_bundle_and_a_prompt() -> None:
    s = spec("qwen3-4b")
    perf = perf_entry(BM1684X)
    short = perf(bundle=_fake_bundle(s), prompt_length=100)
    assert short["decode_variant"] == 256 and short["lm_head_quant"] == "bf16"
    mid = perf(bundle=_fake_bundle(s), prompt_length=300)
    assert mid["decode_variant"] == 512 and mid["decode_tps"] < short["decode_tps"]
    # 700 tokens: 1 prefill + 2 prefill_kv segments of 256
    long = perf(bundle=_fake_bundle(s), prompt_length=700)
    assert long["prefill_breakdown_s"]["prefill_kv_s"] > 0
    assert long["ftl_s"] > 2.5 * short["ftl_s"]
    assert short["ftl_s"] == pytest.approx(sum(v for k, v in short["prefill_breakdown_s"].items()))
    with pytest.raises(TopqError, match="prefill_kv"):
        predict_bundle(_fake_bundle(s, prefill_kv=False), BM1684X, prompt_length=700)


def test_perf_entry_reads_a_real_bundle(tiny_host: Any) -> None:
    bundle = tiny_host("qwen3").bundle
    result = perf_entry(BM1684X)(bundle=bundle, prompt_length=5)
    assert result["seq_length"] == 64 and result["max_input_length"] == 16
    assert result["decode_variant"] == 16
    assert result["quant"] == "f32" and math.isfinite(result["ftl_s"]) and result["decode_tps"] > 0
