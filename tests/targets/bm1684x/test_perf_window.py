"""The bm1684x performance model honors sliding windows: a sliding layer's decode reads at most `window` KV
positions and its prefill computes at most `window` keys per query, checked against hand calculations on the
published Mistral-7B-v0.1 (every layer slides, window 4096) and Gemma-3-1B (five sliding layers of window 512 to
one global) configs (tests/data/configs)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from data_paths import CONFIGS

from topq.core.family import ModelSpec, find_family
from topq.core.plugins import get_plugins
from topq.core.stages import StageConfig, build_program
from topq.ir.graph import Function
from topq.plugins.targets.bm1684x.perf import attended_keys, estimate_function, predict
from topq.plugins.targets.bm1684x.spec import BM1684X

BF16 = 2
#: the calibration streams K/V once per query head (`Calibration.kv_per_query_head`)
PER_QUERY_HEAD = True


def spec_of(name: str, **overrides: Any) -> ModelSpec:
    config = {**json.loads((CONFIGS / f"{name}.json").read_text()), **overrides}
    return find_family(get_plugins().families, config).normalize(config)


def attention_row(function: Function) -> Any:
    (row,) = [r for r in estimate_function(function, BM1684X, "w4bf16").rows if r.name == "FAttention"]
    return row


def kv_read(positions: int, heads: int, d: int) -> int:
    """K and V of `positions` rows, read once per query head, bf16."""
    return 2 * positions * heads * d * BF16


@pytest.mark.parametrize(("queries", "keys", "masked", "window"), [
    (1, 8193, True, 4096), (1, 100, True, 4096), (2048, 2048, False, 512), (2048, 2048, False, 0),
    (16, 80, True, 24), (16, 80, False, 24), (7, 7, False, 3), (5, 12, False, 20)])
def test_attended_keys_equal_a_loop_over_queries(queries: int, keys: int, masked: bool, window: int) -> None:
    history = keys - queries
    want = 0
    for i in range(queries):
        visible = keys if masked else history + i + 1
        want += min(visible, window) if window else visible
    assert attended_keys(queries, keys, masked, window) == want


def test_mistral_decode_reads_at_most_the_window() -> None:
    seq = 8192
    spec, full = spec_of("mistral-7b-v0.1"), spec_of("mistral-7b-v0.1", sliding_window=None)
    layers, heads, kv_heads, d = 32, 32, 8, 128
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.window(0)) == (
        layers, heads, kv_heads, d, 4096)
    sliding, dense = predict(spec, BM1684X, "w4bf16", seq), predict(full, BM1684X, "w4bf16", seq)
    # a decode step at full context: 4096 of the 8193 positions in every layer (2 GiB, per query head)
    assert sliding["kv_bytes_per_token"] == layers * kv_read(4096, heads, d) == 2 ** 31
    assert dense["kv_bytes_per_token"] == layers * kv_read(seq + 1, heads, d)
    assert sliding["bytes_per_token"] == dense["bytes_per_token"] - layers * kv_read(seq + 1 - 4096, heads, d)
    # decode is DDR-bound: the step is faster by about the ratio of bytes moved
    speedup = sliding["decode_tps"] / dense["decode_tps"]
    assert speedup > 1.3 and speedup == pytest.approx(dense["bytes_per_token"] / sliding["bytes_per_token"], rel=0.05)
    # below the window the window changes nothing
    assert sliding["bytes_per_token_by_context"]["2048"] == dense["bytes_per_token_by_context"]["2048"]
    # the attention op of one decode step, by hand: q, 4 query heads per KV head × (K + V of 4096 rows), the
    # output and the [1, 1, 1, 8193] bf16 mask rounded up to the 512-byte DMA burst
    module = build_program(spec, find_family(get_plugins().families, {"architectures": ["MistralForCausalLM"]}),
                           StageConfig(seq, 512, decode_chunks=()), shapes=None)
    row = attention_row(module["block_cache_0"])
    q = heads * d * BF16
    mask = -(-(seq + 1) * BF16 // 512) * 512
    assert row.bytes == q + (heads // kv_heads) * 2 * 4096 * kv_heads * d * BF16 + q + mask
    assert row.flops == 4.0 * heads * 4096 * d  # QKᵀ and PV over the window only


def test_gemma3_sliding_layers_read_their_window_and_global_layers_everything() -> None:
    seq = 2048
    spec = spec_of("gemma-3-1b")
    heads, kv_heads, d = 4, 1, 256
    windows = [spec.window(i) for i in range(spec.num_layers)]
    assert windows.count(512) == 22 and windows.count(0) == 4 and windows[5] == 0  # every sixth layer is global
    r = predict(spec, BM1684X, "w4bf16", seq)
    assert r["kv_bytes_per_token"] == 22 * kv_read(512, heads, d) + 4 * kv_read(seq + 1, heads, d)
    assert r["kv_cache_bytes"] == 2 * 26 * seq * kv_heads * d * BF16  # the cache itself keeps every position
    # prefill of 2048 tokens: a sliding layer computes at most 512 keys per query, a global one the causal triangle
    family = find_family(get_plugins().families, {"architectures": ["Gemma3ForCausalLM"]})
    module = build_program(spec, family, StageConfig(seq, seq, decode_chunks=()), shapes=None)
    local = 512 * 513 // 2 + (seq - 512) * 512
    assert attention_row(module["block_0"]).flops == 4.0 * heads * local * d
    assert attention_row(module["block_5"]).flops == 4.0 * heads * (seq * (seq + 1) // 2) * d
    assert np.isclose(local / (seq * (seq + 1) / 2), 0.437, atol=1e-3)
