"""The bm1684x / bm1688 target: lowering, packing, layer groups, DDR plan, emulator numerics against the host
reference, the checker, the KV-cache mirror, and bad input."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from host_bundles import TinyCheckpoint

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.inspect import describe
from topq.core.pipeline import convert, linear_weight_names, load_model, make_quantizer
from topq.core.plugins import get_plugins
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session
from topq.core.target import CompileJob
from topq.ir.graph import Function, Module
from topq.ir.parser import parse_module
from topq.ir.printer import print_module
from topq.plugins.targets.bm1684x import TARGETS, make_target, open_bundle
from topq.plugins.targets.bm1684x.emulator import Emulator
from topq.plugins.targets.bm1684x.packing import dequantize, pack
from topq.plugins.targets.bm1684x.spec import BM1684X, BM1688, KiB

STAGES: dict[str, Any] = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [16, 32]}
S, L = 64, 16
G64 = {"group_size": 64}


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Any:
    """A tiny random llama (hidden 64, intermediate 128, 2 layers) saved as safetensors; returns (model, dir)."""
    directory = tmp_path_factory.mktemp("bm_tiny")
    return tiny_checkpoint("llama", directory), directory


def recipe(directory: Path, chip: str, scheme: str, out: Path, **quant: Any) -> Any:
    return recipe_from_defaults(model={"path": str(directory)}, quant={"scheme": scheme, **quant},
                                target={"chip": chip}, stages=STAGES, output={"path": str(out)})


@pytest.fixture(scope="session")
def bundle(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Bundle]:
    """`bundle(chip, scheme, **quant)`: converted once per session."""
    cache: dict[tuple[Any, ...], Bundle] = {}
    out_dir = tmp_path_factory.mktemp("bm_bundles")

    def get(chip: str, scheme: str, **quant: Any) -> Bundle:
        if not scheme.startswith("w") or quant.get("group_size") == 64:
            quant.pop("group_size", None)  # the default, or meaningless for a float scheme: one bundle
        key = (chip, scheme, repr(sorted(quant.items())))  # repr: option values may be dicts (calibration)
        if key not in cache:
            out = out_dir / f"{len(cache)}_{chip}_{scheme}.topq"
            convert(recipe(tiny[1], chip, scheme, out, **quant), progress=False)
            cache[key] = Bundle(out)
        return cache[key]

    return get


def function_inputs(function: Function, seed: int) -> list[np.ndarray]:
    """Inputs a Session could pass: random hidden/history, positions continuing a history of `start` tokens, the
    runtime's mask (unfilled history hidden) with a few more history columns hidden at random."""
    rng = np.random.default_rng(seed)
    types = [a.type for a in function.args]
    if function.name.startswith("embedding"):
        return [rng.integers(0, 256, size=types[0].shape).astype(np.int32)]
    if function.name == "lm_head":
        return [rng.normal(size=types[0].shape).astype(np.float32)]
    hidden = rng.normal(size=types[0].shape).astype(np.float32)
    length = types[0].shape[1]
    stage = function.attrs["stage"]
    if stage == "prefill":
        return [hidden, np.arange(length, dtype=np.int32)[None]]
    history = types[3].shape[1]
    start = 7 if stage == "prefill_kv" else history // 2 + 1
    positions = np.minimum(np.arange(start, start + length), S - 1).astype(np.int32)[None]
    mask = np.zeros(types[2].shape, np.float32)
    mask[..., start:history] = -np.inf
    mask[..., rng.choice(start, size=2, replace=False)] = -np.inf
    hist = [rng.normal(size=t.shape).astype(np.float32) for t in types[3:5]]
    return [hidden, positions, mask, *hist]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def function_cosines(bm: Bundle, host: Bundle, checker: bool = False) -> dict[str, float]:
    """Worst output cosine per function, both executors on identical inputs."""
    emulator = open_bundle(bm, BM1684X if bm.target == "bm1684x" else BM1688, checker=checker)
    reference = get_plugins().targets.get("host").open(host)
    module = parse_module(host.program)
    out = {}
    for i, function in enumerate(module):
        inputs = function_inputs(function, seed=i)
        got = emulator.run(function.name, inputs)
        want = reference.run(function.name, inputs)
        assert [g.shape for g in got] == [w.shape for w in want], function.name
        assert all(np.isfinite(g).all() for g in got), function.name
        out[function.name] = min(cosine(g, w) for g, w in zip(got, want))
    return out


# ------------------------------------------------------------------------------------------ numerics

NUMERICS = [
    ("bm1684x", "f32", {}, 0.999999),
    ("bm1684x", "bf16", {}, 0.9999),
    ("bm1684x", "f16", {}, 0.9999),
    ("bm1684x", "w4bf16", {**G64, "symmetric": False}, 0.99),
    ("bm1684x", "w4bf16", {**G64, "symmetric": True}, 0.99),
    ("bm1684x", "w8bf16", {**G64, "symmetric": False}, 0.999),
    ("bm1684x", "w8bf16", {**G64, "symmetric": True}, 0.999),
    ("bm1684x", "w4f16", {**G64, "symmetric": False}, 0.99),
    ("bm1684x", "w8f16", {"group_size": -1, "symmetric": True}, 0.999),
    ("bm1688", "bf16", {}, 0.9999),
    ("bm1688", "w4bf16", {**G64, "symmetric": False}, 0.99),
]


@pytest.mark.parametrize(("chip", "scheme", "quant", "threshold"), NUMERICS,
                         ids=[f"{c}-{s}-{q.get('symmetric', '')}{q.get('group_size', '')}" for c, s, q, _ in NUMERICS])
def test_every_function_matches_host(bundle: Callable[..., Bundle], chip: str, scheme: str, quant: dict[str, Any],
                                     threshold: float) -> None:
    """Same scheme on both sides: the host's weights are the scheme's values in f32; the chip rounds every
    activation, the KV cache and the attention probabilities to bf16/f16."""
    cos = function_cosines(bundle(chip, scheme, **quant), bundle("host", scheme, **quant))
    assert len(cos) == 13
    worst = min(cos, key=cos.get)  # type: ignore[arg-type]
    assert cos[worst] >= threshold, (worst, cos[worst])


def test_weight_only_error_against_float_model(bundle: Callable[..., Bundle]) -> None:
    """The quantization itself: chip W8 / W4 (group 64) against the float32 host, per function. The tiny model's
    weights are i.i.d. Gaussian, the worst case for 4-bit groups (real checkpoints: see emulator_quality.py)."""
    host = bundle("host", "f32")
    for scheme, threshold in (("w8bf16", 0.999), ("w4bf16", 0.97)):
        cos = function_cosines(bundle("bm1684x", scheme, **G64), host)
        assert min(cos.values()) >= threshold, (scheme, cos)


def margins(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


@pytest.mark.parametrize(("chip", "scheme", "margin"), [("bm1684x", "bf16", 1e-2), ("bm1688", "bf16", 1e-2),
                                                       ("bm1684x", "w8bf16", 2e-2), ("bm1684x", "w4bf16", 0.1)])
def test_greedy_tokens_match_host(bundle: Callable[..., Bundle], chip: str, scheme: str, margin: float) -> None:
    """Teacher-forced on the host's greedy tokens (same scheme): every step whose host top-2 margin exceeds `margin`
    picks the same token. The prompt (20 tokens) takes a prefill and a prefill_kv; decoding crosses the 32 and 64
    decode variants. W4 gets a wider margin: its activations differ more once rounded to bf16. Quantized weights
    get a wider one than float: the chip also rounds each dequantized weight to bf16, the host keeps the scheme's
    exact values."""
    host, bm = Session(bundle("host", scheme, **G64)), Session(bundle(chip, scheme, **G64))
    prompt = [1, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]
    steps = [(token, logits) for token, logits in host.generate(prompt, 40, stop_ids=[])]
    checked = 0
    got = bm.feed(prompt)
    for i, (token, want) in enumerate(steps):
        assert cosine(got, want) > 0.999, i
        if margins(want) > margin:
            assert int(np.argmax(got)) == token, (i, margins(want))
            checked += 1
        if i < len(steps) - 1:
            got = bm.decode(token)
    assert checked >= 25
    assert {"block_0", "block_kv_0", "block_cache_0_32", "block_cache_0"} <= set(bm.calls)


def test_sessions_share_an_executor_and_chat_turns(bundle: Callable[..., Bundle]) -> None:
    """Two interleaved sessions on one emulator, truncation and a later turn: all equal fresh recomputation."""
    b = bundle("bm1684x", "bf16")
    shared = open_bundle(b, BM1684X)
    a, c = Session(b, shared), Session(b, shared)
    la = a.feed([3, 4, 5, 6])
    lc = c.feed([9, 8, 7])
    for step in range(4):
        la = a.decode(int(np.argmax(la)))
        lc = c.decode(int(np.argmax(lc)) if step != 2 else 42)
    a.truncate(5)
    la = a.feed([100, 101, 102])  # a prefill_kv on the truncated cache
    # recomputed from scratch (one prefill: the same values up to f32 summation order in the attention)
    for got, tokens in ((la, a.tokens), (lc, c.tokens)):
        want = Session(b).feed(tokens)
        assert cosine(got, want) > 0.99999 and np.abs(got - want).max() < 0.05


def test_kv_history_is_mirrored_with_copies_of_new_rows_only(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "bf16")
    module = parse_module(b.program)
    for function in module:
        assert not any(op.name == "tpu.Concat" for op in function.ops), function.name
        if function.name.startswith(("block_cache", "block_kv")):
            stores = {op.attrs["kind"]: op.attrs["addr"] for op in function.ops if op.name == "tpu.KVStore"}
            assert function.attrs["arg_addrs"][3:5] == [stores["k"], stores["v"]]  # history = the cache region
    emulator = open_bundle(b, BM1684X)
    session = Session(b, emulator)
    logits = session.feed(list(range(1, 11)))  # prefill of 10 tokens
    for _ in range(6):
        logits = session.decode(int(np.argmax(logits)))
    # each mirror copied the 10 prefill rows once, then one row per later decode step (the first decode reads the
    # prefill's rows; the last decode's row is not read yet)
    assert {m.copied for m in emulator.kv.values()} == {10 + 5}


# ------------------------------------------------------------------------------------------ packing


def independent_layout(w: np.ndarray, bits: int, group: int, symmetric: bool) -> dict[str, np.ndarray]:
    """The A16MatMul storage written from the formulas, with plain loops over groups."""
    n, k = w.shape
    codes = np.zeros((n, k), np.int64)
    scales = np.zeros((n, k // group), np.float32)
    zps = np.zeros((n, k // group), np.int64)

    def away(x: np.ndarray) -> np.ndarray:
        return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))

    for r in range(n):
        for gi in range(k // group):
            g = w[r, gi * group:(gi + 1) * group]
            if symmetric:
                s = np.abs(g).max() / np.float32(2 ** (bits - 1) - 1)
                c = np.clip(away(g / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
                z = 0
            else:
                s = (g.max() - g.min()) / np.float32(2**bits - 1)
                z = int(np.clip(away(-g.min() / s), 0, 2**bits - 1))
                c = np.clip(away(g / s) + z, 0, 2**bits - 1)
            codes[r, gi * group:(gi + 1) * group] = c
            scales[r, gi], zps[r, gi] = s, z
    if bits == 8:
        weight = codes.astype(np.int8) if symmetric else codes.astype(np.uint8)
    else:
        u = np.where(codes < 0, codes + 16, codes).reshape(n, k // 2, 2)
        weight = (u[..., 0] + 16 * u[..., 1]).astype(np.uint8)  # even k low nibble, odd k high nibble
    out = {"packed": weight, "scale": scales.astype(ml_dtypes.bfloat16)}
    if not symmetric:
        out["zp"] = zps.astype(np.uint8)
    return out


@pytest.mark.parametrize(("scheme", "symmetric"), [("w4bf16", False), ("w4bf16", True), ("w8bf16", False),
                                                   ("w8bf16", True)])
def test_packed_tensors_match_an_independent_layout(bundle: Callable[..., Bundle], tiny: Any, scheme: str,
                                                    symmetric: bool) -> None:
    b = bundle("bm1684x", scheme, **G64, symmetric=symmetric)
    model = tiny[0]
    bits = int(scheme[1])
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    for name in names:
        w = model.state_dict()[name].numpy().astype(np.float32)
        want = independent_layout(w, bits, 64, symmetric)
        assert b.tensor(name + ".packed").shape == ((w.shape[0], w.shape[1] // 2) if bits == 4 else w.shape)
        for part, array in want.items():
            got = b.tensor(f"{name}.{part}")
            assert got.dtype == array.dtype, (name, part)
            np.testing.assert_array_equal(got.view(np.uint8), array.view(np.uint8), err_msg=f"{name}.{part}")
        assert (f"{name}.zp" in b.tensor_names()) == (not symmetric)
        assert name not in b.tensor_names()  # the float copy is not shipped
    # lm_head stays bf16 by default (quant.lm_head), unquantized
    assert b.tensor("lm_head.weight").dtype == ml_dtypes.bfloat16


def test_pack_round_trip_equals_the_host_dequantization() -> None:
    from topq.ir.types import round_to_dtype
    from topq.plugins.quant.rtn import quantize

    w = np.random.default_rng(3).normal(size=(24, 128)).astype(np.float32)
    for bits in (4, 8):
        for symmetric in (False, True):
            for dtype in ("bf16", "f16"):
                q = quantize(w, {"group_size": 32, "symmetric": symmetric}, bits=bits, compute_dtype=dtype)
                parts = pack(q, dtype)
                got = dequantize(parts["weight"], parts["scale"], parts.get("zp"), bits, 32, dtype)
                np.testing.assert_array_equal(got, round_to_dtype(q.dequantize(), dtype))


def test_lm_head_quantized_when_asked(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "w4bf16", **G64, lm_head="w4bf16")
    assert "lm_head.weight.packed" in b.tensor_names() and "lm_head.weight" not in b.tensor_names()
    cos = function_cosines(b, bundle("host", "w4bf16", **G64, lm_head="w4bf16"))
    assert cos["lm_head"] >= 0.9999


# ------------------------------------------------------------------------------------------ checker


#: every built-in scheme the chip runs (it chooses by what a scheme produces, not by name)
CHIP_SCHEMES = ("f32", "bf16", "f16", "w8bf16", "w4bf16", "w8f16", "w4f16", "auto", "gptq", "awq", "autoround", "int8")


@pytest.mark.parametrize("scheme", CHIP_SCHEMES)
def test_checker_passes_every_function(bundle: Callable[..., Bundle], scheme: str,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    quant: dict[str, Any] = G64 if scheme.startswith("w") else {}
    if get_plugins().schemes.get(scheme).calibrate is not None:  # int8, gptq, awq, autoround calibrate on token ids
        ids = tmp_path_factory.mktemp(f"{scheme}_ids") / "calib.ids"
        ids.write_text(" ".join(str(i % 256) for i in range(0, 4000, 7)))
        quant = {"group_size": 32, "iters": 10, "calibration": {"data": str(ids), "samples": 2, "seq_len": 16}}
    b = bundle("bm1684x", scheme, **quant)
    emulator = open_bundle(b, BM1684X, checker=True)
    for i, function in enumerate(parse_module(bundle("host", "f32").program)):
        outs = emulator.run(function.name, function_inputs(function, seed=100 + i))
        assert all(np.isfinite(o).all() for o in outs)
    session = Session(b, emulator)  # checks the KV mirror against the session's cache on every call
    logits = session.feed(list(range(2, 22)))
    for _ in range(3):
        logits = session.decode(int(np.argmax(logits)))


def tampered(b: Bundle, edit: Callable[[Module], None]) -> Emulator:
    module = parse_module(b.program)
    edit(module)
    return Emulator(print_module(module), b.tensor, BM1684X, checker=True)


def op_by_loc(function: Function, loc: str) -> Any:
    return next(op for op in function.ops if op.loc == loc)


def test_checker_names_both_tensors_of_an_overlap(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "bf16")

    def overlap(module: Module) -> None:  # rope_sin written over rope_cos while the ropes still need it
        f = module["block_0"]
        op_by_loc(f, "layers.0.rope_sin").attrs["addr"] = op_by_loc(f, "layers.0.rope_cos").attrs["addr"]

    inputs = function_inputs(parse_module(b.program)["block_0"], 0)
    with pytest.raises(TopqError, match=r"checker: .*layers\.0\.rope_sin.* overlaps live .*layers\.0\.rope_cos"):
        tampered(b, overlap).run("block_0", inputs)
    open_bundle(b, BM1684X, checker=True).run("block_0", inputs)  # the real plan passes


def test_checker_fails_on_a_read_of_a_freed_buffer(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "bf16")

    def stale(module: Module) -> None:  # the v view points at rope_cos's bytes, freed after the ropes
        f = module["block_0"]
        v_view = f.results[2].owner
        v_view.attrs["addr"] = op_by_loc(f, "layers.0.rope_cos").attrs["addr"]

    inputs = function_inputs(parse_module(b.program)["block_0"], 0)
    with pytest.raises(TopqError) as info:
        tampered(b, stale).run("block_0", inputs)
    message = str(info.value)
    assert "layers.0.v_proj" in message and "layers.0.rope_cos" in message and "dead" in message, message


def test_checker_poisons_freed_regions(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "bf16")
    emulator = open_bundle(b, BM1684X, checker=True)
    function = parse_module(b.program)["block_0"]
    emulator.run("block_0", function_inputs(function, 0))
    cos = op_by_loc(function, "layers.0.rope_cos")
    addr, nbytes = cos.attrs["addr"], cos.results[0].type.nbytes
    assert (emulator.ddr[addr:addr + nbytes] == 0xFF).all()
    assert np.isnan(emulator.ddr[addr:addr + nbytes].view(ml_dtypes.bfloat16).astype(np.float32)).all()


# ------------------------------------------------------------------------------------------ passes


def test_memory_plan_and_layer_groups(bundle: Callable[..., Bundle]) -> None:
    b = bundle("bm1684x", "w4bf16", **G64)
    module = parse_module(b.program)
    coeff, kv, act = (module.attrs[f"bm.{r}"] for r in ("coeff", "kv", "act"))
    assert coeff[0] + coeff[1] <= kv[0] and kv[0] + kv[1] <= act[0]
    for function in module:
        addrs = [op.attrs["addr"] for op in function.ops if "addr" in op.attrs] + function.attrs["arg_addrs"]
        assert all(a % BM1684X.global_align == 0 for a in addrs)
        groups = [op.attrs["group"] for op in function.ops if op.name != "tpu.Weight"]
        assert groups == sorted(groups) and groups[0] == 0  # consecutive ops
        for op in function.ops:
            if op.name == "tpu.Weight":
                assert coeff[0] <= op.attrs["addr"] < coeff[0] + coeff[1]
            elif "addr" in op.attrs and op.name != "tpu.KVStore":
                assert act[0] <= op.attrs["addr"] < act[0] + act[1]
    decode = module["block_cache_0"]
    names = [op.name for op in decode.ops if op.name != "tpu.Weight"]
    assert names.count("tpu.A16MatMul") == 4 and "tpu.A16MLP" in names and "tpu.MatMul" not in names
    report = b.meta["target_meta"]["layer_groups"]["block_cache_0"]
    assert report["local_values"] > 0 and report["groups"] < len(names)
    info = describe(b)
    assert "DDR plan" in info["text_sections"][0] and info["memory"]["total"] == module.attrs["bm.ddr"][0]
    # the per-op predicted time table: rows for prefill, decode and the head, summing to each function's time
    assert set(info["predicted_ops"]) == {"block_0", "block_cache_0", "lm_head"}
    assert any(r["name"] == "MLP" and r["time_s"] > 0 for r in info["predicted_ops"]["block_cache_0"])
    assert "@block_cache_0:" in info["text_sections"][-1] and "time us" in info["text_sections"][-1]


def test_small_local_memory_tiles_and_still_runs(tiny: Any, tmp_path: Path) -> None:
    """A chip with 8 KiB per lane: big ops get sequence / channel slices, groups shrink; numerics unchanged."""
    chip = dataclasses.replace(BM1684X, name="bm1684x", local_mem_per_lane=8 * KiB, lanes=4)
    job = compile_job(tiny[1], "bf16", tmp_path)
    compiled = make_target(chip).compile(job)
    reports = compiled.metadata["layer_groups"]
    assert reports["block_0"]["tiled"] and reports["lm_head"]["tiled"]
    assert all(r["peak_lmem_per_lane"] <= chip.local_mem_per_lane for r in reports.values())
    module = parse_module(compiled.program)
    assert any("tiling" in op.attrs for op in module["block_0"].ops)
    tensors = dict(compiled.produce(list(compiled.manifest)))
    emulator = Emulator(compiled.program, tensors.__getitem__, chip, checker=True)
    function = module["block_0"]
    assert all(np.isfinite(o).all() for o in emulator.run("block_0", function_inputs(function, 1)))


# ------------------------------------------------------------------------------------------ bad input


def compile_job(directory: Path, scheme: str, tmp: Path, **quant: Any) -> CompileJob:
    r = recipe(directory, "bm1684x", scheme, tmp / "unused.topq", **quant)
    plugins = get_plugins()
    model = load_model(r, plugins)
    names = linear_weight_names(model.module)
    quantizer = make_quantizer(model, r, plugins, names)
    return CompileJob(module=model.module, spec=model.spec, weights=model.weight,
                      scheme=plugins.schemes.get(scheme), quant_options=r.to_dict()["quant"], recipe=r.to_dict(),
                      linear_weights=names, quantized=quantizer.values, quant_spec=quantizer.spec)


def test_group_size_must_divide_k(tiny: Any, tmp_path: Path) -> None:
    with pytest.raises(TopqError, match=r"group_size 48 does not divide the input size 64"):
        convert(recipe(tiny[1], "bm1684x", "w4bf16", tmp_path / "x.topq", group_size=48), progress=False)


def test_model_exceeding_ddr_reports_sizes(tiny: Any, tmp_path: Path) -> None:
    small = dataclasses.replace(BM1684X, name="tinychip", ddr_size=256 * KiB)
    with pytest.raises(TopqError) as info:
        make_target(small).compile(compile_job(tiny[1], "bf16", tmp_path))
    assert re.fullmatch(r"model does not fit tinychip DDR: needs [\d.]+ KiB \(weights [\d.]+ KiB, KV cache "
                        r"[\d.]+ KiB, activations [\d.]+ KiB\), the chip has 256.0 KiB", str(info.value)), \
        str(info.value)


def test_bundles_for_another_chip_or_mode_are_refused(bundle: Callable[..., Bundle]) -> None:
    other = bundle("bm1688", "bf16")
    with pytest.raises(TopqError, match="compiled for bm1688, not bm1684x"):
        TARGETS[0].open(other)
    with pytest.raises(TopqError, match="compiled for host, not bm1684x"):
        TARGETS[0].open(bundle("host", "bf16"))
    odd = Bundle(other.path)
    odd.meta["target_meta"]["dtype"] = "i4"
    with pytest.raises(TopqError, match=r"mode 'bf16' computes in 'i4', which the bm1688 emulator cannot run; "
                                        r"it runs: f32, bf16, f16"):
        TARGETS[1].open(odd)


def test_weights_the_chip_cannot_pack_are_refused_naming_them(tiny: Any, tmp_path: Path) -> None:
    """The target refuses what a scheme produces (3-bit weights), before calibrating, not the scheme's name."""
    with pytest.raises(TopqError, match=r"^target bm1684x cannot run 3-bit weights \(tpu.A16MatMul packs 4- or "
                                        r"8-bit weights\)$"):
        convert(recipe(tiny[1], "bm1684x", "gptq", tmp_path / "x.topq", bits=3), progress=False)


def test_wrong_input_shapes_are_errors(bundle: Callable[..., Bundle]) -> None:
    emulator = open_bundle(bundle("bm1684x", "bf16"), BM1684X)
    with pytest.raises(TopqError, match=r"@block_0: input 0 of shape \[1, 2, 64\], expected \[1, 16, 64\]"):
        emulator.run("block_0", [np.zeros((1, 2, 64), np.float32), np.zeros((1, 16), np.int32)])
    with pytest.raises(TopqError, match="takes 1 inputs, got 2"):
        emulator.run("lm_head", [np.zeros((1, 1, 64), np.float32)] * 2)


def test_checker_from_environment_or_recipe(bundle: Callable[..., Bundle], monkeypatch: pytest.MonkeyPatch) -> None:
    b = bundle("bm1684x", "bf16")
    assert open_bundle(b, BM1684X).checker is None
    monkeypatch.setenv("TOPQ_CHECKER", "1")
    assert open_bundle(b, BM1684X).checker is not None
    monkeypatch.delenv("TOPQ_CHECKER")
    odd = Bundle(b.path)
    odd.meta["recipe"]["target"]["checker"] = True
    assert open_bundle(odd, BM1684X).checker is not None


def test_lean_kernels_equal_the_reference_bit_for_bit() -> None:
    from topq.ir.reference_ops import REFERENCE_OPS
    from topq.plugins.targets.bm1684x.kernels import rmsnorm, rope

    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 7, 3, 64)).astype(np.float32)
    cos, sin = (rng.normal(size=(1, 7, 64)).astype(np.float32) for _ in range(2))
    for mode in ("contiguous_halves", "interleaved_pairs"):
        attrs = {"mode": mode}
        np.testing.assert_array_equal(rope([x, cos, sin], attrs)[0], REFERENCE_OPS["top.Rope"]([x, cos, sin], attrs)[0])
    h, w = rng.normal(size=(1, 5, 96)).astype(np.float32), rng.normal(size=96).astype(np.float32)
    np.testing.assert_array_equal(rmsnorm([h, w], {"eps": 1e-5})[0],
                                  REFERENCE_OPS["top.RMSNorm"]([h, w], {"eps": 1e-5})[0])


@pytest.mark.parametrize(("kind", "quant"), [("qwen2", {"scheme": "w4bf16"}), ("qwen3", {"scheme": "bf16"}),
                                             ("llama_tied", {"scheme": "w8bf16", "lm_head": "w8bf16"})])
def test_other_families(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint, kind: str,
                        quant: dict[str, Any]) -> None:
    """Attention biases (qwen2: A16MatMul with bias), per-head q/k norms (qwen3), a tied embedding quantized as
    lm_head while the gather keeps the bf16 table (llama_tied)."""
    directory = tmp_path_factory.mktemp(f"bm_{kind}")
    tiny_checkpoint(kind, directory / "model")
    out = {}
    for chip in ("host", "bm1684x"):
        convert(recipe(directory / "model", chip, out=directory / f"{chip}.topq", **quant), progress=False)
        out[chip] = Bundle(directory / f"{chip}.topq")
    cos = function_cosines(out["bm1684x"], out["host"])
    assert min(cos.values()) >= 0.999, cos
    names = out["bm1684x"].tensor_names()
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if kind == "llama_tied":
        assert {"model.embed_tokens.weight", "model.embed_tokens.weight.packed"} <= set(names)


@pytest.mark.parametrize(("kind", "quant", "threshold"), [
    ("qwen3_moe", {"scheme": "bf16"}, 0.9999),
    ("qwen3_moe", {"scheme": "w4bf16", "group_size": 32}, 0.999),
    ("qwen2_moe", {"scheme": "w4bf16", "group_size": 32}, 0.999),
    ("qwen2_moe", {"scheme": "w8bf16", "group_size": 32, "symmetric": True}, 0.999),
    ("mixtral", {"scheme": "bf16"}, 0.9999),
])
def test_mixture_of_experts(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint, kind: str,
                            quant: dict[str, Any], threshold: float) -> None:
    """top.MoE lowers to one tpu.MoE per sparse layer (BF16 or packed W4 experts; qwen2_moe with its gated shared
    expert and a dense layer), and every function matches the host bundle of the same scheme."""
    directory = tmp_path_factory.mktemp(f"bm_{kind}")
    tiny_checkpoint(kind, directory / "model")
    out = {}
    for chip in ("host", "bm1684x"):
        path = directory / f"{chip}_{quant['scheme']}.topq"
        convert(recipe(directory / "model", chip, out=path, **quant), progress=False)
        out[chip] = Bundle(path)
    cos = function_cosines(out["bm1684x"], out["host"])
    assert min(cos.values()) >= threshold, cos
    counts = out["bm1684x"].meta["target_meta"]["op_counts"]
    sparse_layers = 1 if kind == "qwen2_moe" else 2  # the tiny qwen2_moe has mlp_only_layers [1]
    functions = 1 + 1 + 3  # prefill, prefill_kv, three decode variants per layer
    assert counts["tpu.MoE"] == sparse_layers * functions
    names = set(out["bm1684x"].tensor_names())
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert (expert + ".packed" in names) == quant["scheme"].startswith("w")
