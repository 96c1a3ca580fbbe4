"""GPTQ v1 zero points of 0 (issue 16): v1 writers subtract 0x11111111 from each whole packed qzeros word, so a
zero of 0 borrows from the next field. The import must give back the exact zeros; checked against a packing and a
dequantization written here from the layout alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_bundles import TinyCheckpoint

from topq.io.safetensors import SafetensorsFile, write_safetensors
from topq.plugins.formats.hf import open_checkpoint

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_fields(values: np.ndarray, axis: int) -> np.ndarray:
    """4-bit values packed 8 per uint32 word along `axis`, value i of a word at bits 4i (LSB first)."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((v.shape[0] // 8, *v.shape[1:]), dtype=np.uint32)
    for i in range(8):
        words |= v[i::8] << np.uint32(4 * i)
    return np.moveaxis(words, 0, axis)


def gptq_v1_tensors(n: int, k: int, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """qweight / qzeros / scales of a random 4-bit asymmetric linear whose zero points include many 0s, written as
    GPTQModel writes v1 (whole-word subtraction), and the weight they stand for."""
    groups = k // GROUP
    codes = rng.integers(0, 16, size=(n, k))
    zeros = rng.integers(0, 16, size=(n, groups))
    zeros[rng.random(zeros.shape) < 0.3] = 0
    scales = (rng.random((n, groups)) * 0.02 + 0.001).astype(np.float16)
    weight = (codes - np.repeat(zeros, GROUP, axis=1)) * np.repeat(scales.astype(np.float32), GROUP, axis=1)
    qzeros_v2 = pack_fields(np.ascontiguousarray(zeros.T), axis=1)  # [G, N/8]
    qzeros_v1 = (qzeros_v2.astype(np.int64) - 0x11111111) % (1 << 32)  # the borrow crosses fields
    tensors = {"qweight": pack_fields(np.ascontiguousarray(codes.T), axis=0).view(np.int32),  # [K/8, N]
               "qzeros": qzeros_v1.astype(np.uint32).view(np.int32),
               "scales": np.ascontiguousarray(scales.T),
               "g_idx": (np.arange(k) // GROUP).astype(np.int32)}
    return tensors, weight.astype(np.float32)


@pytest.fixture(scope="module")
def v1_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                  tiny_checkpoint: TinyCheckpoint) -> tuple[Path, dict[str, np.ndarray]]:
    src = tmp_path_factory.mktemp("gptq_v1_float")
    tiny_checkpoint("llama", src)
    rng = np.random.default_rng(7)
    source = SafetensorsFile(src / "model.safetensors")
    tensors: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}
    for name in source.names():
        array = np.asarray(source.get_raw(name))
        prefix = name[: -len(".weight")]
        if not prefix.endswith(LINEARS):
            tensors[name] = array
            continue
        packed, expected[name] = gptq_v1_tensors(*array.shape, rng)
        tensors.update({f"{prefix}.{part}": value for part, value in packed.items()})
    dst = tmp_path_factory.mktemp("gptq_v1")
    config: dict[str, Any] = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                     "sym": False, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(config))
    write_safetensors(dst / "model.safetensors", tensors)
    return dst, expected


def test_zero_points_of_zero_are_read_exactly(v1_checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    directory, expected = v1_checkpoint
    store = open_checkpoint(directory).weights
    zero_groups = 0
    for name, weight in expected.items():
        q = store.quantized(name)
        assert q is not None and q.bits == 4 and q.group_size == GROUP
        np.testing.assert_array_equal(q.dequantize(), weight, err_msg=name)
        zero_groups += int(np.sum(q.zeros == 0))
    assert zero_groups > 100  # the case under test really occurs


def test_per_field_reading_would_be_wrong(v1_checkpoint: tuple[Path, dict[str, np.ndarray]]) -> None:
    """The old per-field `(field & 15) + 1` reading of the same words gives other zero points: the test data
    exercises the borrow."""
    directory, _ = v1_checkpoint
    file = SafetensorsFile(directory / "model.safetensors")
    words = np.asarray(file.get_raw("model.layers.0.self_attn.q_proj.qzeros")).view(np.uint32)
    per_field = np.stack([((words >> np.uint32(4 * i)) & np.uint32(15)) + 1 for i in range(8)], axis=-1)
    exact = open_checkpoint(directory).weights.quantized("model.layers.0.self_attn.q_proj.weight")
    assert exact is not None
    assert not np.array_equal(per_field.reshape(words.shape[0], -1).T, exact.zeros)
