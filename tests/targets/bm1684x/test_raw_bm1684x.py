"""Raw kernels on the bm1684x target: lowering to staged + inlined kernel IR, emulation on a simulated local memory
(exact in F32 mode, staged through bf16 in BF16 mode), the local-memory checker, the too-large-operands error, the
performance model's element-op count, and SmolLM2 with its SiLU replaced by a raw kernel on bm1684x BF16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from smol_model import SMOL_RECIPE_PATH

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.plugins import get_plugins
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.core.target import CompileJob
from topq.ir.builder import Builder
from topq.ir.graph import Function, Module
from topq.ir.parser import parse_module
from topq.ir.types import TensorType
from topq.plugins.targets.bm1684x import open_bundle
from topq.plugins.targets.bm1684x.compiler import compile_model
from topq.plugins.targets.bm1684x.emulator import Emulator
from topq.plugins.targets.bm1684x.perf import estimate_function
from topq.plugins.targets.bm1684x.raw import element_ops, is_local_buffer
from topq.plugins.targets.bm1684x.spec import BM1684X, MiB
from topq.raw import InOut, Input, Num, kernel, raw_call
from topq.raw.library import rms_norm, silu

F32 = np.float32
SHAPE = (1, 6, 48)  # [batch, tokens, features]: 48 = 3 x 16, so buffers are 64-byte multiples


@kernel
def leaky_relu(x: Input["tensor<?x?x?xf32>"], y: InOut["tensor<?x?x?xf32>"], slope: Num["f32"]) -> None:
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for c in range(x.shape[2]):
                v = x[b, t, c]
                if v > 0.0:
                    r = v
                else:
                    r = v * slope
                y[b, t, c] = r


@kernel
def prefix_sum(x: Input["tensor<?xf32>"], y: InOut["tensor<?xf32>"]) -> None:
    """A triangular nest (the inner bound depends on i): the element-op count must enumerate it."""
    for i in range(x.shape[0]):
        acc = 0.0
        for j in range(i + 1):
            acc = acc + x[j]
        y[i] = acc


# ------------------------------------------------------------------------------------------------ references


def silu_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(120) = inf: the limit -0.0
        return x / (F32(1) + np.exp(-x))


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    acc = np.zeros(x.shape[:-1], F32)
    for c in range(x.shape[-1]):  # left to right, as the kernel sums
        acc = acc + x[..., c] * x[..., c]
    r = F32(1) / np.sqrt(acc / F32(x.shape[-1]) + F32(eps))
    return x * r[..., None] * w


def leaky_ref(x: np.ndarray, slope: float) -> np.ndarray:
    return np.where(x > 0, x, x * F32(slope))


def activations(seed: int) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(SHAPE) * 4).astype(F32)
    x[0, 0, :4] = [-120.0, 120.0, 0.0, -0.0]  # exp overflow and signed zeros
    return x


NORM_W = np.random.default_rng(7).standard_normal(SHAPE[-1]).astype(F32)
EPS = 1e-5
#: name → (build the DSLRegion from the function's input, the numpy float32 reference)
KERNELS: dict[str, tuple[Callable[[Builder, Any], Any], Callable[[np.ndarray], np.ndarray]]] = {
    "silu": (lambda b, x: raw_call(b, silu, [x], [x], loc="act"), silu_ref),
    "rms_norm": (lambda b, x: raw_call(b, rms_norm, [x], [x, b.weight("norm.w", TensorType((SHAPE[-1],)))],
                                       loc="norm", eps=EPS),
                 lambda x: rms_norm_ref(x, NORM_W, EPS)),
    "leaky_relu": (lambda b, x: raw_call(b, leaky_relu, [x], [x], loc="leaky", slope=0.01),
                   lambda x: leaky_ref(x, 0.01)),
}


# ------------------------------------------------------------------------------------------------ helpers


def one_kernel_module(name: str, shape: tuple[int, ...] = SHAPE) -> Module:
    b = Builder()
    with b.function("main", TensorType(shape)) as f:
        f.returns(KERNELS[name][0](b, f.args[0]))
    return b.module


def compile_top(module: Module, scheme: str = "f32", checker: bool = True) -> tuple[Emulator, Any]:
    """Compile a Top module for bm1684x (weights from NORM_W) and open it on the emulator."""
    job = CompileJob(module=module, spec=None, weights={"norm.w": NORM_W}.__getitem__,  # type: ignore[arg-type]
                     scheme=get_plugins().schemes.get(scheme), quant_options={}, recipe={})
    compiled = compile_model(job, BM1684X)
    tensors = dict(compiled.produce(list(compiled.manifest)))
    return Emulator(compiled.program, tensors.__getitem__, BM1684X, checker=checker), compiled


def op_names(function: Function) -> list[str]:
    return [op.name for op in function.ops]


# ------------------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name", list(KERNELS))
def test_f32_emulator_equals_numpy_exactly(name: str) -> None:
    emulator, compiled = compile_top(one_kernel_module(name))
    x = activations(seed=len(name))
    (got,) = emulator.run("main", [x])
    want = KERNELS[name][1](x)
    assert got.dtype == F32 and np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 stays -0.0
    # What ran: staged buffers around inlined kernel IR, one layer group of its own; no region is left.
    main = emulator.module["main"]
    names = op_names(main)
    assert "tpu.DSLRegion" not in compiled.program and "top.DSLRegion" not in compiled.program
    operands = 3 if name == "rms_norm" else 2  # outputs then inputs: y, x (, w)
    assert names.count("tpu.LocalAlloc") == names.count("tpu.LocalStore") == names.count("tpu.LocalFree") == operands
    assert names.count("tpu.LocalLoad") == 1 and "scf.for" in names
    first = names.index("scf.for")
    assert set(names[:first]) <= {"tpu.Weight", "tpu.LocalAlloc", "tpu.LocalStore", "arith.constant"}
    assert names.index("tpu.LocalLoad") > max(i for i, n in enumerate(names) if n == "scf.for")
    accesses = [op for op in main.walk() if op.name.startswith("memref.")]
    buffers = [op.operands[0 if op.name == "memref.load" else 1] for op in accesses]
    assert accesses and all(is_local_buffer(v) for v in buffers)  # the body addresses the staged buffers only
    assert compiled.metadata["layer_groups"]["main"]["groups"] == 1


def test_bf16_staging_converts_at_the_boundary() -> None:
    """BF16 mode: the operand arrives in bf16, the kernel computes in f32 on its exact f32 value, the result is
    rounded to bf16 when it is loaded back to DDR."""
    emulator, compiled = compile_top(one_kernel_module("rms_norm"), scheme="bf16")
    x = activations(seed=3)
    (got,) = emulator.run("main", [x])
    bf16 = ml_dtypes.bfloat16
    w = NORM_W.astype(bf16).astype(F32)  # the weight is stored in bf16 too
    want = rms_norm_ref(x.astype(bf16).astype(F32), w, EPS).astype(bf16).astype(F32)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, rms_norm_ref(x, NORM_W, EPS))  # the rounding did happen
    assert 'tpu.LocalLoad"(%' in compiled.program and 'dtype = "bf16"' in compiled.program


def test_chained_kernels_are_separate_groups_and_exact() -> None:
    """rms_norm → silu → Add: the regions are back to back (each its own group, each placed from offset 0) and the
    value between them goes through DDR; the whole is numpy's composition bit for bit."""
    b = Builder()
    with b.function("main", TensorType(SHAPE)) as f:
        h = KERNELS["rms_norm"][0](b, f.args[0])
        f.returns(b.top.Add(KERNELS["silu"][0](b, h), f.args[0]))
    emulator, compiled = compile_top(b.module)
    x = activations(seed=11)
    (got,) = emulator.run("main", [x])
    assert np.array_equal(got, silu_ref(rms_norm_ref(x, NORM_W, EPS)) + x)
    main = emulator.module["main"]
    groups = {op.attrs["group"] for op in main.ops if op.name.startswith("tpu.Local")}
    assert groups == {0, 1} and compiled.metadata["layer_groups"]["main"]["groups"] == 3
    offsets = [op.attrs["offset"] for op in main.ops if op.name == "tpu.LocalAlloc"]
    nbytes = int(np.prod(SHAPE)) * 4
    assert offsets == [0, nbytes, 2 * nbytes, 0, nbytes]  # y, x, w of rms_norm; y, x of silu
    first_load = next(op for op in main.ops if op.name == "tpu.LocalLoad")
    assert "addr" in first_load.attrs  # crosses a group boundary: a DDR value


# ------------------------------------------------------------------------------------------------ errors


def test_operands_exceeding_local_memory_report_sizes() -> None:
    big = (1, 4096, 1024)  # 16 MiB of f32 per buffer; the kernel stages two
    with pytest.raises(TopqError) as info:
        compile_top(one_kernel_module("silu", big))
    message = str(info.value)
    assert message == ("@main: raw kernel topq.raw.library:silu (act) stages 33554432 B into local memory "
                       "(y tensor<1x4096x1024xf32> 16777216 B, x tensor<1x4096x1024xf32> 16777216 B), more than "
                       "bm1684x's 16777216 B (64 lanes x 262144 B)")
    # Exactly the local memory fits (two 8 MiB buffers): compiles, buffers at 0 and 8 MiB.
    _, compiled = compile_top(one_kernel_module("silu", (1, 2048, 1024)))
    assert "offset = 8388608 : i64" in compiled.program
    assert compiled.metadata["layer_groups"]["main"]["peak_lmem_per_lane"] == 16 * MiB // 64


def _edited(program: str, edit: Callable[[list[Any]], None]) -> Module:
    """The program with its op list edited (not re-parsed: an edit may break SSA order, the emulator runs it)."""
    module = parse_module(program)
    edit(module["main"].body.ops)
    return module


@pytest.fixture(scope="module")
def silu_program() -> str:
    return compile_top(one_kernel_module("silu"))[1].program


@pytest.mark.parametrize(("edit", "message"), [
    # LocalFree of x moved in front of the kernel: the kernel then reads a freed buffer
    (lambda ops: ops.insert(next(i for i, op in enumerate(ops) if op.name == "scf.for"),
                            ops.pop(max(i for i, op in enumerate(ops) if op.name == "tpu.LocalFree"))),
     r"uses local buffer x after it was freed"),
    (lambda ops: ops.append(ops[-1]), r"local buffer x freed twice"),
    (lambda ops: ops.pop(), r"local buffers never freed: x"),
    (lambda ops: ops.insert(0, ops.pop(next(i for i, op in enumerate(ops) if op.name == "tpu.LocalStore"))),
     r"uses local buffer y before it was allocated"),
], ids=["use-after-free", "double-free", "leak", "use-before-alloc"])
def test_checker_tracks_local_buffers(silu_program: str, edit: Callable[[list[Any]], None], message: str) -> None:
    weights: dict[str, np.ndarray] = {}
    x = activations(seed=5)
    good = Emulator(silu_program, weights.__getitem__, BM1684X, checker=True)
    assert np.array_equal(good.run("main", [x])[0], silu_ref(x))
    assert np.isnan(good.local.mem[:64].view(F32)).all()  # freed buffers are poisoned
    bad = Emulator(_edited(silu_program, edit), weights.__getitem__, BM1684X, checker=True)
    with pytest.raises(TopqError, match=message):
        bad.run("main", [x])


# ------------------------------------------------------------------------------------------------ perf model


def test_perf_counts_kernel_element_ops_and_staging_dma() -> None:
    rows = SHAPE[0] * SHAPE[1]
    n = SHAPE[-1]
    numel = rows * n
    regions = {name: next(op for op in one_kernel_module(name)["main"].ops if op.name == "top.DSLRegion")
               for name in KERNELS}
    assert element_ops(regions["silu"].regions[0].block) == {4: 4.0 * numel}  # negf, exp, addf, divf
    # per row: n × (mulf, addf), then divf, addf, rsqrt, then n × (mulf, mulf)
    assert element_ops(regions["rms_norm"].regions[0].block) == {4: rows * (4.0 * n + 3)}
    assert element_ops(regions["leaky_relu"].regions[0].block) == {4: 2.0 * numel}  # cmpf; mulf (both branches)
    b = Builder()
    with b.function("main", TensorType((40,))) as f:
        f.returns(raw_call(b, prefix_sum, [f.args[0]], [f.args[0]]))
    (region,) = [op for op in b.module["main"].ops if op.name == "top.DSLRegion"]
    assert element_ops(region.regions[0].block) == {4: 40 * 41 / 2}

    # In F32 the raw SiLU costs the built-in SiLU's EU time (4 ops per element) and stages y, x in and y out.
    builtin = Builder()
    with builtin.function("main", TensorType(SHAPE)) as f:
        f.returns(builtin.top.SiLU(f.args[0]))
    raw_est = estimate_function(one_kernel_module("silu")["main"], BM1684X, "f32")
    ref_est = estimate_function(builtin.module["main"], BM1684X, "f32")
    (raw_row,), (ref_row,) = raw_est.rows, ref_est.rows
    assert raw_row.name == "DSLRegion" and raw_row.compute_s == pytest.approx(ref_row.compute_s, rel=1e-12)
    assert raw_row.bytes == 3 * 1536 and ref_row.bytes == 2 * 1536  # 1152 B each, rounded up to 512-B bursts


# ------------------------------------------------------------------------------------------------ SmolLM2

SMOL_STAGES: dict[str, Any] = {"seq_length": 256, "max_input_length": 64, "prefill_kv": False}
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
RAW_SILU = [{"replace": "top.SiLU", "with": "topq.raw.library:silu"}]
FUNCTIONS = ("block_0", "block_cache_0", "block_17", "block_cache_29", "lm_head")


@pytest.fixture(scope="session")
def smol_bm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Bundle, Bundle]:
    """SmolLM2 on bm1684x BF16, converted once each: the built-in ops, and top.SiLU replaced by a raw kernel."""
    from topq.core.pipeline import convert

    directory = tmp_path_factory.mktemp("smol_raw_bm")
    out = []
    for name, kernels in (("builtin", []), ("raw", RAW_SILU)):
        recipe = recipe_from_defaults(model={"path": SMOL_RECIPE_PATH}, quant={"scheme": "bf16"},
                                      target={"chip": "bm1684x"}, stages=SMOL_STAGES,
                                      output={"path": str(directory / f"{name}.topq")}, kernels=kernels)
        convert(recipe, progress=False)
        out.append(Bundle(directory / f"{name}.topq"))
    return out[0], out[1]


def block_inputs(function: Function, seed: int) -> list[np.ndarray]:
    """Hidden states, positions and (decode) a history a quarter full with the rest masked."""
    rng = np.random.default_rng(seed)
    types = [a.type for a in function.args]
    if function.name == "lm_head":
        return [rng.normal(size=types[0].shape).astype(F32)]
    hidden = rng.normal(size=types[0].shape).astype(F32)
    length = types[0].shape[1]
    if len(types) == 2:
        return [hidden, np.arange(length, dtype=np.int32)[None]]
    history = types[3].shape[1]
    start = history // 4
    mask = np.zeros(types[2].shape, F32)
    mask[..., start:history] = -np.inf
    hist = [rng.normal(size=t.shape).astype(F32) for t in types[3:5]]
    return [hidden, np.array([[start]], np.int32), mask, *hist]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def test_smollm2_raw_silu_on_bm1684x_bf16(smol_bm: tuple[Bundle, Bundle]) -> None:
    builtin, raw = smol_bm
    assert raw.program.count('"tpu.LocalLoad"') == 60  # 30 layers × (prefill, decode), one SiLU each
    assert '"tpu.DSLRegion"' not in raw.program and '"tpu.MLP"' not in raw.program
    assert '"tpu.MLP"' in builtin.program and '"tpu.LocalAlloc"' not in builtin.program
    # Every output of a handful of functions, both on identical inputs; the raw one under the checker.
    checked = open_bundle(raw, BM1684X, checker=True)
    reference = open_bundle(builtin, BM1684X)
    module = parse_module(raw.program)
    cosines = {}
    for i, name in enumerate(FUNCTIONS):
        inputs = block_inputs(module[name], seed=i)
        got, want = checked.run(name, inputs), reference.run(name, inputs)
        assert [g.shape for g in got] == [w.shape for w in want]
        cosines[name] = min(cosine(g, w) for g, w in zip(got, want))
    print(f"\nSmolLM2 bm1684x BF16, raw SiLU vs built-in, worst cosine per function: {cosines}")
    assert min(cosines.values()) >= 0.9999, cosines
    # Greedy tokens: a prefill and four decode steps, the raw program under the checker.
    runs = [list(Session(b, e).generate(PROMPT, 5, stop_ids=[])) for b, e in ((builtin, reference), (raw, checked))]
    tokens = [[t for t, _ in run] for run in runs]
    print(f"tokens {tokens[1]}, logits cosine {min(cosine(a, b) for (_, a), (_, b) in zip(*runs)):.7f}")
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5
