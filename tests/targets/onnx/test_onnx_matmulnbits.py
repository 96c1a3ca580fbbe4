"""Weight-only linears on the onnx target as com.microsoft.MatMulNBits.

* the packed bytes against an independent implementation of the layout in ORT's ContribOperators.md;
* the weight ORT multiplies by equals `QuantizedWeight.dequantize()` exactly (a one-linear graph fed the identity);
* tiny models (W4 g32 asymmetric, W8 per channel, GPTQ with act-order, AWQ, AutoRound, a quantized tied lm_head):
  ORT logits at accuracy_level 0 within 1e-3 of the host bundle of the same scheme (both multiply by the scheme's
  exact dequantized weights, see docs/onnx.md), and the same greedy tokens;
* what MatMulNBits cannot hold is refused before any value is computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.pipeline import convert, linear_weight_names, load_model, make_quantizer
from topq.core.plugins import get_plugins
from topq.core.quant import QuantizedWeight
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.ir.interpreter import Interpreter
from topq.ir.types import round_to_dtype
from topq.plugins.targets.onnx import packing
from topq.plugins.targets.onnx.lowering import MS_DOMAIN, OPSET, GraphBuilder

STAGES = {"seq_length": 64, "max_input_length": 16}
IDS = [5, 9, 77, 120, 3, 44, 200, 17, 8, 61, 250, 33, 90]


# ------------------------------------------------------------------------------------ layout and exactness

def random_weight(rng: np.random.Generator, n: int, k: int, bits: int, group_size: int, symmetric: bool,
                  act_order: bool = False) -> QuantizedWeight:
    """Codes, scales and zero points as schemes make them (signed codes with zero 0 when symmetric)."""
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1)
    groups = k // group_size
    zeros = np.zeros((n, groups)) if symmetric else rng.integers(0, 1 << bits, (n, groups)).astype(np.float32)
    g_idx = (np.arange(k) // group_size)[rng.permutation(k)] if act_order else None
    return QuantizedWeight(rng.integers(lo, hi + 1, (n, k)), rng.uniform(1e-3, 0.1, (n, groups)).astype(np.float32),
                           zeros, bits, group_size, symmetric, g_idx)


def documented_layout(q: QuantizedWeight, block: int) -> dict[str, np.ndarray]:
    """ContribOperators.md, MatMulNBits, written out element by element: B [N, k_blocks, block·bits/8] with the
    unsigned codes of a block bit-packed along K (4-bit: first value in the low nibble); scales [N, k_blocks];
    zero_points [N, ceil(k_blocks·bits/8)] packed the same way (omitted = 2^(bits-1), what symmetric codes are
    shifted by). Act-order columns are first sorted by group (the graph gathers the inputs the same way)."""
    n, k = q.codes.shape
    bits = q.bits
    shift = 1 << (bits - 1) if q.symmetric else 0
    order = np.argsort(q.g_idx, kind="stable") if q.g_idx is not None else np.arange(k)
    blocks = -(-k // block)
    per_byte = 8 // bits
    b_bytes = np.zeros((n, blocks, block * bits // 8), np.uint8)
    zp_bytes = np.zeros((n, -(-blocks * bits // 8)), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    for row in range(n):
        for blk in range(blocks):
            first = blk * block
            group = min(first // q.group_size, q.scales.shape[1] - 1)
            zero = int(q.zeros[row, group]) + shift
            scales[row, blk] = q.scales[row, group]
            zp_bytes[row, blk // per_byte] |= zero << (bits * (blk % per_byte))
            for j in range(block):
                col = first + j
                value = int(q.codes[row, order[col]]) + shift if col < k else zero
                b_bytes[row, blk, j // per_byte] |= value << (bits * (j % per_byte))
    out = {"w.qweight": b_bytes, "w.scales": scales}
    if not q.symmetric:
        out["w.zero_points"] = zp_bytes
    if q.g_idx is not None:
        out["w.perm"] = order
    return out


# (N, K, bits, group_size, symmetric, act_order): K = 80 per channel pads its one 128-wide block
LAYOUTS = [(48, 64, 4, 32, False, False), (48, 64, 4, 16, True, False), (40, 80, 8, 80, False, False),
           (40, 80, 8, 80, True, False), (24, 64, 4, 32, False, True), (24, 64, 8, 16, True, True),
           (20, 96, 4, 96, False, False), (16, 256, 4, 128, False, False)]


@pytest.mark.parametrize("n,k,bits,group_size,symmetric,act_order", LAYOUTS)
def test_packed_bytes_follow_the_documented_layout(n: int, k: int, bits: int, group_size: int, symmetric: bool,
                                                   act_order: bool) -> None:
    q = random_weight(np.random.default_rng(k + bits), n, k, bits, group_size, symmetric, act_order)
    packed = packing.pack(q, "w")
    expected = documented_layout(q, packing.block_size(q.spec))
    assert set(packed) == set(expected)
    for name, array in expected.items():
        assert packed[name].dtype == array.dtype or name == "w.perm", name
        np.testing.assert_array_equal(packed[name], array, err_msg=name)
    for name, t in packing.layout(q.spec).items():  # the manifest layout (known before values) is what is packed
        assert packed[f"w.{name}"].shape == t.shape and packed[f"w.{name}"].dtype == t.np_dtype


def ort_weight(q: QuantizedWeight, accuracy_level: int = 0) -> np.ndarray:
    """The [K, N] weight ORT multiplies by: a graph of one lowered linear, fed the K×K identity."""
    n, k = q.codes.shape
    lowering = packing.lowering("w", q.spec, accuracy_level)
    graph = GraphBuilder("one_linear")
    graph.node("Identity", [lowering.emit(graph, "x", "w")], ["y"])
    packed = packing.pack(q, "w")
    initializers = [numpy_helper.from_array(packed[t.name], t.name) for t in lowering.tensors]
    model = helper.make_model(
        helper.make_graph(graph.nodes, "one_linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])],
                          initializer=graph.constants + initializers),
        ir_version=10, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.eye(k, dtype=np.float32)})[0]


@pytest.mark.parametrize("n,k,bits,group_size,symmetric,act_order", LAYOUTS)
def test_ort_uses_exactly_the_dequantized_weight(n: int, k: int, bits: int, group_size: int, symmetric: bool,
                                                 act_order: bool) -> None:
    q = random_weight(np.random.default_rng(k * bits), n, k, bits, group_size, symmetric, act_order)
    np.testing.assert_array_equal(ort_weight(q), q.dequantize().T)


# ------------------------------------------------------------------------------------ tiny models

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_models import build_tiny

    dirs = {}
    for kind in ("llama", "llama_tied"):
        d = tmp_path_factory.mktemp(f"onnx_q_{kind}")
        build_tiny(kind, d)
        dirs[kind] = d
    ids = np.random.default_rng(0).integers(3, 250, 400)
    (dirs["llama"] / "calib.ids").write_text(" ".join(map(str, ids)))
    return dirs


def calibration(d: Path) -> dict[str, Any]:
    return {"data": str(d / "calib.ids"), "samples": 4, "seq_len": 32}


SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "w4_g32_asym": ("llama", {"scheme": "w4bf16", "group_size": 32, "symmetric": False}),
    "w8_per_channel": ("llama", {"scheme": "w8bf16", "group_size": -1}),
    "gptq_act_order": ("llama", {"scheme": "gptq", "group_size": 32, "act_order": True}),
    "awq_g32": ("llama", {"scheme": "awq", "group_size": 32}),
    "autoround_g64_sym": ("llama", {"scheme": "autoround", "group_size": 64, "symmetric": True, "iters": 10}),
    "w4_sym_tied_lm_head": ("llama_tied", {"scheme": "w4f16", "group_size": 16, "symmetric": True,
                                           "lm_head": "w4f16"}),
}


def convert_to(d: Path, chip: str, quant: dict[str, Any], name: str, **target: Any) -> tuple[Bundle, Any]:
    recipe = recipe_from_defaults(model={"path": str(d)}, target={"chip": chip, **target}, stages=STAGES,
                                  output={"path": str(d / f"{name}_{chip}.topq")}, quant=quant)
    convert(recipe, progress=False)
    return Bundle(d / f"{name}_{chip}.topq"), recipe


def exact_reference(bundle: Bundle, recipe: Any) -> Session:
    """The host interpreter on the scheme's own values: quantized linears as `dequantize()` (no rounding to the
    compute dtype), every other weight rounded to it as both targets store it."""
    model = load_model(recipe)
    quantizer = make_quantizer(model, recipe, get_plugins(), linear_weight_names(model.module))
    dtype = get_plugins().schemes.get(recipe.quant.scheme).compute_dtype

    def weight(name: str) -> np.ndarray:
        q = quantizer.values(name)
        # in the bundle's memory order (row-major): on some BLAS kernels (OpenBLAS SkylakeX) a product with the
        # transposed layout rounds differently
        return np.ascontiguousarray(q.dequantize()) if q is not None else round_to_dtype(model.weight(name), dtype)

    reference = Interpreter(model.module, weight)
    # the host's batched logits (one lm_head call per segment), so both sides sum the lm_head product alike
    reference.any_positions, reference.lm_head_rows = frozenset({"lm_head"}), True  # type: ignore[attr-defined]
    return Session(bundle, executor=reference)


@pytest.mark.parametrize("case", list(SCHEMES))
def test_quantized_tiny_models_match_the_host(tiny: dict[str, Path], case: str) -> None:
    kind, quant = SCHEMES[case]
    d = tiny[kind]
    if quant["scheme"] in ("gptq", "awq", "autoround"):
        quant = {**quant, "calibration": calibration(d)}
    onnx_bundle, recipe = convert_to(d, "onnx", quant, case)
    host_bundle, _ = convert_to(d, "host", quant, case)
    assert onnx_bundle.meta["target_meta"]["matmul_nbits"] == 7 * 2 + (quant.get("lm_head") == "w4f16")
    if quant.get("act_order"):
        assert "model.layers.0.mlp.down_proj.weight.perm" in onnx_bundle.tensor_names()
    assert onnx_bundle.meta["target_meta"]["accuracy_level"] == 0
    got = Session(onnx_bundle).feed(IDS, all_logits=True)
    host = Session(host_bundle).feed(IDS, all_logits=True)
    # the host bundle holds the scheme's exact dequantized weights, as the interpreter run on them does
    np.testing.assert_array_equal(host, exact_reference(host_bundle, recipe).feed(IDS, all_logits=True))
    assert float(np.abs(got - host).max()) <= 1e-3
    tokens = [[t for t, _ in session.generate(IDS[:6], 12, stop_ids=[])]
              for session in (Session(onnx_bundle), Session(host_bundle))]
    assert tokens[0] == tokens[1]


def matmulnbits_levels(bundle: Bundle) -> set[int]:
    import onnx

    graph = onnx.load_from_string(bytes(bundle.tensor(bundle.meta["target_meta"]["functions"]["block_0"]["graph"])))
    return {helper.get_attribute_value(a) for n in graph.graph.node if n.op_type == "MatMulNBits"
            for a in n.attribute if a.name == "accuracy_level"}


def test_accuracy_level_is_a_target_option(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`target.accuracy_level: 4` (int8 activations in MatMulNBits) is compiled into the graphs: close to the
    default level 0, not equal; TOPQ_ONNX_ACCURACY_LEVEL sets another level when a bundle is opened."""
    d = tiny["llama"]
    quant = {"scheme": "w4bf16", "group_size": 32}
    exact_bundle, _ = convert_to(d, "onnx", quant, "level0")
    int8_bundle, _ = convert_to(d, "onnx", quant, "level4", accuracy_level=4)
    assert (matmulnbits_levels(exact_bundle), matmulnbits_levels(int8_bundle)) == ({0}, {4})
    assert int8_bundle.meta["target_meta"]["accuracy_level"] == 4
    exact = Session(exact_bundle).feed(IDS, all_logits=True)
    int8 = Session(int8_bundle).feed(IDS, all_logits=True)
    assert 0 < float(np.abs(int8 - exact).max()) < 0.1 * float(np.abs(exact).max())
    monkeypatch.setenv("TOPQ_ONNX_ACCURACY_LEVEL", "0")
    np.testing.assert_array_equal(Session(int8_bundle).feed(IDS, all_logits=True), exact)
    monkeypatch.setenv("TOPQ_ONNX_ACCURACY_LEVEL", "7")
    with pytest.raises(TopqError, match="TOPQ_ONNX_ACCURACY_LEVEL must be one of 0, 1, 2, 3, 4"):
        Session(exact_bundle)


@pytest.mark.parametrize(("chip", "level", "message"), [
    ("onnx", "5", "target.accuracy_level: must be at most 4, got 5"),
    ("onnx", "fast", "target.accuracy_level: expected an integer, got 'fast'"),
    ("host", "4", "target.accuracy_level = 4 does not apply to target host"),
])
def test_a_bad_accuracy_level_is_one_error_line(tiny: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                chip: str, level: str, message: str) -> None:
    d = tiny["llama"]
    recipe = d / "level.yaml"
    out = d / f"level_{chip}_{level}.topq"
    recipe.write_text(f"model: {{path: {d}}}\nquant: {{scheme: w4bf16, group_size: 32}}\ntarget: {{chip: {chip}}}\n"
                      f"stages: {{seq_length: 64, max_input_length: 16}}\noutput: {{path: {out}}}\n")
    code = cli.main(["convert", str(recipe), "--set", f"target.accuracy_level={level}"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


# ------------------------------------------------------------------------------------ refusals

def test_a_group_size_matmulnbits_cannot_take_is_refused_before_any_work(tiny: dict[str, Path],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    d = tiny["llama"]
    computed: list[str] = []
    real_pack = packing.pack
    monkeypatch.setattr(packing, "pack", lambda q, name: computed.append(name) or real_pack(q, name))
    with pytest.raises(TopqError, match=r"model\.layers\.0\.\S+: group size 8 cannot be a MatMulNBits block size; "
                                        r"allowed: powers of two >= 16 \(16, 32, 64, 128, \.\.\.\) or per channel"):
        convert_to(d, "onnx", {"scheme": "w4bf16", "group_size": 8}, "g8")
    assert computed == [] and not (d / "g8_onnx.topq").exists()
    capsys.readouterr()
    recipe = d / "g8.yaml"
    recipe.write_text(f"model: {{path: {d}}}\nquant: {{scheme: w4f16, group_size: 8}}\ntarget: {{chip: onnx}}\n"
                      f"stages: {{seq_length: 64, max_input_length: 16}}\noutput: {{path: {d / 'g8_cli.topq'}}}\n")
    code = cli.main(["convert", str(recipe)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "group size 8" in err


def test_int8_w8a8_is_refused_with_a_clear_error(tiny: dict[str, Path]) -> None:
    """Refused from what the scheme produces, before calibration (the calibration file does not even exist)."""
    d = tiny["llama"]
    with pytest.raises(TopqError, match=r"target onnx cannot run int8 activations"):
        convert_to(d, "onnx", {"scheme": "int8", "calibration": {**calibration(d), "data": str(d / "nope.ids")}},
                   "int8")


# ------------------------------------------------------------------------------------ pre-quantized checkpoints

def stored_linear_weight(bundle: Bundle, name: str) -> np.ndarray:
    """The [K, N] weight ORT multiplies by for the bundle's linear `name`: its nodes (the act-order Gather and the
    MatMulNBits) cut out of the bundle's graph, fed the identity, with the bundle's packed tensors."""
    import onnx

    graph_name = bundle.meta["target_meta"]["functions"]["block_cache_1"]["graph"]
    model = onnx.load_from_string(bytes(bundle.tensor(graph_name)))
    matmul = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{name}.qweight")
    nodes = [matmul]
    producer = next((n for n in model.graph.node if matmul.input[0] in n.output and n.op_type == "Gather"), None)
    if producer is not None:
        nodes.insert(0, producer)
    attrs = {a.name: helper.get_attribute_value(a) for a in matmul.attribute}
    k, n = attrs["K"], attrs["N"]
    first_input = nodes[0].input[0]
    inputs = {i for node in nodes for i in node.input} - {first_input} - {o for node in nodes for o in node.output}
    initializers = [numpy_helper.from_array(np.asarray(bundle.tensor(i)), i) for i in sorted(inputs)]
    cut = helper.make_model(
        helper.make_graph(nodes, "cut", [helper.make_tensor_value_info(first_input, TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info(matmul.output[0], TensorProto.FLOAT, [k, n])],
                          initializer=initializers),
        ir_version=model.ir_version, opset_imports=list(model.opset_import))
    session = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {first_input: np.eye(k, dtype=np.float32)})[0]


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_auto_imports_keep_the_checkpoint_values(tiny: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """`quant.scheme: auto` on GPTQ (asymmetric, act-order), AWQ and compressed-tensors (symmetric) checkpoints:
    the weight ORT multiplies by is the checkpoint's own dequantized weight."""
    from quantized_writers import write_quantized_llama

    qdir = tmp_path / fmt
    dequantized = write_quantized_llama(tiny["llama"], qdir, fmt)
    bundle, _ = convert_to(qdir, "onnx", {"scheme": "auto"}, "auto")
    assert bundle.meta["target_meta"]["matmul_nbits"] == len(dequantized) == 14
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        got = stored_linear_weight(bundle, name)
        np.testing.assert_allclose(got, dequantized[name].T, rtol=1e-6, atol=1e-7, err_msg=name)
    assert ("model.layers.1.mlp.down_proj.weight.perm" in bundle.tensor_names()) == (fmt == "gptq")
    logits = Session(bundle).feed(IDS, all_logits=True)
    assert np.isfinite(logits).all() and logits.shape == (len(IDS), 256)
