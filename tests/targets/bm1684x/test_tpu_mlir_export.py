"""`topq export tpu-mlir` without TPU-MLIR: the exported Top MLIR text (golden files), weights and refusals.

Regenerate the golden files after an intended change of the export with
`TOPQ_UPDATE_GOLDEN=1 python -m pytest tests/targets/bm1684x/test_tpu_mlir_export.py`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from tpu_mlir_nets import write_recipe

from topq.core.cli import main
from topq.core.errors import TopqError
from topq.ir.graph import Function, Operation
from topq.ir.types import tensor
from topq.plugins.exporters.tpu_mlir.translate import translate_function

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "tpu_mlir"

@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind → export directory of a one-layer tiny model (files only, no TPU-MLIR)."""
    from tiny_models import build_tiny

    out: dict[str, Path] = {}
    for kind in ("qwen2", "llama", "qwen3"):
        root = tmp_path_factory.mktemp(f"tpu_mlir_{kind}")
        build_tiny(kind, root / "model", overrides={"num_hidden_layers": 1})
        recipe = write_recipe(root, root / "model")
        assert main(["export", "tpu-mlir", str(recipe), str(root / "export"), "--json"]) == 0
        out[kind] = root / "export"
    return out


def golden_check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("TOPQ_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; create it with TOPQ_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file"


NETS = ["embedding", "embedding_cache", "block_0", "block_kv_0", "block_cache_0", "block_cache_0_1", "lm_head",
        "greedy_head"]


@pytest.mark.parametrize("net", NETS)
def test_qwen2_nets_match_golden_text(exported: dict[str, Path], net: str) -> None:
    golden_check(f"qwen2/{net}.mlir", (exported["qwen2"] / net / f"{net}.mlir").read_text(encoding="utf-8"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_other_families_block_golden_text(exported: dict[str, Path], kind: str) -> None:
    for net in ("block_0", "block_cache_0"):
        golden_check(f"{kind}/{net}.mlir", (exported[kind] / net / f"{net}.mlir").read_text(encoding="utf-8"))


def test_net_layout_and_manifest(exported: dict[str, Path]) -> None:
    manifest = json.loads((exported["qwen2"] / "export.json").read_text(encoding="utf-8"))
    assert sorted(n["name"] for n in manifest["nets"]) == sorted(NETS)
    assert manifest["quantize"] == "bf16"
    block = next(n for n in manifest["nets"] if n["name"] == "block_0")
    assert [(i["name"], i["shape"], i["dtype"]) for i in block["inputs"]] == [
        ("input_states", [1, 16, 64], "f32"), ("position_ids", [1, 16], "si32"),
        ("attention_mask", [1, 1, 16, 16], "f32")]
    assert block["outputs"] == ["output_states", "k_cache", "v_cache"]
    kv = next(n for n in manifest["nets"] if n["name"] == "block_kv_0")
    # topq's small key mask [1,1,1,S+L] becomes TPU-MLIR's full prefill mask [1,1,L,S+L]
    assert kv["inputs"][2] == {"name": "attention_mask", "shape": [1, 1, 16, 80], "dtype": "f32"}
    decode = next(n for n in manifest["nets"] if n["name"] == "block_cache_0")
    assert "io_alone" in decode["model_deploy"] and "basic" in block["model_deploy"]
    chunk = next(n for n in manifest["nets"] if n["name"] == "block_cache_0_1")
    assert chunk["inputs"][3]["shape"] == [1, 32, 2, 16]  # the 32-slot decode chunk


def test_weights_are_keyed_by_loc_in_tpu_mlir_layout(exported: dict[str, Path]) -> None:
    from safetensors.numpy import load_file

    directory = exported["qwen2"] / "block_0"
    text = (directory / "block_0.mlir").read_text(encoding="utf-8")
    weights = np.load(directory / "block_0_top_weights.npz")
    locs = re.findall(r'"top.Weight"\(\) : \(\) -> tensor<([0-9x]+)xf32> loc\(fused\["([^"]+)"\]\)', text)
    assert sorted(weights.files) == sorted(name for _, name in locs)
    for dims, name in locs:
        assert weights[name].shape == tuple(int(d) for d in dims.split("x")), name
    original = load_file(str(exported["qwen2"].parent / "model" / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    np.testing.assert_array_equal(weights[f"{q}.weight"], original[f"{q}.weight"].T)  # [K, N]
    np.testing.assert_array_equal(weights[f"{q}.bias"], original[f"{q}.bias"].reshape(1, 1, -1))
    assert weights["rope.cos"].shape == (64, 1, 16)  # [S, 1, D]


def test_rope_operands_and_prefill_mask(exported: dict[str, Path]) -> None:
    text = (exported["qwen2"] / "block_0" / "block_0.mlir").read_text(encoding="utf-8")
    gather = r'(%\d+) = "top.Gather"\(%\d+, %\d+\) \{axis = 0 : si32\} : .* loc\(fused\["layers.0.rope_(\w+)"\]\)'
    ssa = dict(re.findall(gather, text))
    by_table = {table: value for value, table in ssa.items()}
    ropes = re.findall(r'"top.Rope"\((%\d+), (%\d+), (%\d+)\) \{rope_mode = "contiguous_halves"\}', text)
    assert len(ropes) == 2 and all(sin == by_table["sin"] and cos == by_table["cos"] for _, sin, cos in ropes)
    mask_input = re.search(r'(%\d+) = "top.Input"\(%arg2\).*loc\(fused\["attention_mask"\]\)', text)
    assert mask_input is not None
    assert re.search(rf'"top.FAttention"\(%\d+, %\d+, %\d+, {mask_input.group(1)}, %0\)', text)
    assert "top.MLP" not in text and text.count('"top.SiLU"') == 1


def _function_with(op_name: str) -> Function:
    """block_0(x) = OP(x, x): a function using one op of the given name."""
    function = Function("block_0")
    x = function.body.add_arg(tensor(1, 4, 8))
    op = Operation(op_name, [x, x], [tensor(1, 4, 8)], loc="kernel")
    function.body.ops.append(op)
    function.results.append(op.results[0])
    return function


def test_unmapped_op_is_refused_by_name() -> None:
    for op_name in ("top.DSLRegion", "top.A8MatMul", "top.MatMulInt8"):
        with pytest.raises(TopqError, match=rf"function block_0: op {re.escape(op_name)} has no TPU-MLIR mapping"):
            translate_function(_function_with(op_name), lambda name: np.zeros(1, np.float32))


def test_cli_refusals(tmp_path: Path, exported: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write_recipe(tmp_path, exported["qwen2"].parent / "model")
    assert main(["export", "no-such-exporter", str(recipe), str(tmp_path / "x")]) == 1
    assert "tpu-mlir" in capsys.readouterr().err  # the known exporters are listed
    assert main(["export", "tpu-mlir", str(recipe), str(tmp_path / "x"), "--option", "colour=blue"]) == 1
    assert "unknown option 'colour'" in capsys.readouterr().err
    assert main(["export", "tpu-mlir", str(recipe), str(tmp_path / "x"), "--tpu-mlir", str(tmp_path)]) == 1
    assert "not a TPU-MLIR python" in capsys.readouterr().err
    int8 = write_recipe(tmp_path, exported["qwen2"].parent / "model", scheme="int8")
    assert main(["export", "tpu-mlir", str(int8), str(tmp_path / "y")]) == 1
    assert "int8 (W8A8) has no TPU-MLIR route" in capsys.readouterr().err


def test_a16_operands_pack_topq_codes_as_tpu_mlir_reads_them() -> None:
    from topq.core.quant import QuantizedWeight
    from topq.plugins.exporters.tpu_mlir.translate import a16_operands

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (6, 8))
    q = QuantizedWeight(codes, rng.random((6, 2)).astype(np.float32), rng.integers(0, 16, (6, 2)), 4, 4, False)
    packed, _, zeros = a16_operands(q, "w")
    assert packed.shape == (6, 4) and packed.dtype == np.uint8 and zeros.dtype == np.uint8
    np.testing.assert_array_equal(packed & 0xF, codes[:, 0::2])  # even K column in the low nibble
    np.testing.assert_array_equal(packed >> 4, codes[:, 1::2])
    # topq's signed symmetric codes are the same values with TPU-MLIR's offset 2^(bits-1)
    signed = QuantizedWeight(codes - 8, q.scales, np.zeros((6, 2), np.int64), 4, 4, True)
    packed_s, _, zeros_s = a16_operands(signed, "w")
    np.testing.assert_array_equal(packed_s, packed)
    assert np.all(zeros_s == 8)
    eight = QuantizedWeight(rng.integers(0, 256, (6, 8)), q.scales, q.zeros, 8, 4, False)
    assert a16_operands(eight, "w")[0].shape == (6, 8)
    shuffled = QuantizedWeight(codes, q.scales, q.zeros, 4, 4, False, g_idx=np.array([1, 0, 0, 0, 1, 1, 1, 0]))
    with pytest.raises(TopqError, match="act-order"):
        a16_operands(shuffled, "w")


def test_prequantized_route_writes_a16_matmuls(tmp_path: Path, exported: dict[str, Path]) -> None:
    recipe = write_recipe(tmp_path, exported["qwen2"].parent / "model", scheme="w4bf16", quant={"group_size": 32})
    out = tmp_path / "export"
    assert main(["export", "tpu-mlir", str(recipe), str(out), "--option", "route=prequantized", "--json"]) == 0
    text = (out / "block_0" / "block_0.mlir").read_text(encoding="utf-8")
    assert 'module.platform = "LLM_QUANTIZED"' in text
    assert text.count('"top.A16MatMul"') == 7 and '"top.MatMul"' not in text  # q, k, v, o, gate, up, down
    assert re.search(r'"top.A16MatMul"\(%\d+, %\d+, %\d+, %\d+, %\d+\) \{q_group_size = 32 : i64, right_transpose = '
                     r'true, weight_bits = 4 : i64\}', text)
    weights = np.load(out / "block_0" / "block_0_top_weights.npz")
    base = "model.layers.0.self_attn.q_proj"
    assert weights[f"{base}.qweight"].shape == (64, 32) and weights[f"{base}.qweight"].dtype == np.uint8
    assert weights[f"{base}.scales"].shape == (64, 2) and weights[f"{base}.qzeros"].shape == (64, 2)
    lm_head = (out / "lm_head" / "lm_head.mlir").read_text(encoding="utf-8")
    assert '"top.MatMul"' in lm_head  # quant.lm_head: bf16 keeps the head in float
    manifest = json.loads((out / "export.json").read_text(encoding="utf-8"))
    assert manifest["route"] == "prequantized"
    assert main(["export", "tpu-mlir", str(recipe), str(tmp_path / "x"), "--option", "route=sideways"]) == 1
