"""Calibration through the executor interface: the per-sample loops of the weight-only layer loop and of int8
observation run as tasks (this process, a forked pool, Ray) with byte-identical bundles; Ray unit workers load the
converting process's calibration result instead of calibrating again; `Observer.merge`; the RTN error report."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_paths import AUSTEN
from host_bundles import TinyCheckpoint

from topq.core.errors import TopqError
from topq.quant.observers import Observer

STAGES = {"seq_length": 32, "max_input_length": 16, "decode_chunks": [32]}
CALIBRATION = {"samples": 6, "seq_len": 16}
QUANT: dict[str, dict[str, Any]] = {
    "gptq": {"group_size": 32},
    "awq": {"group_size": 32},  # its scale and clip candidates run on the threads of --jobs 2 (GroupInputs.map)
    "int8": {"observer": "kl", "smooth_alpha": 0.5},
    # torch's bf16 products in every task (topq.ir.products): thread-count independent, so the same bytes too
    "gptq-bf16": {"group_size": 32, "calibration_matmul": "bf16"},
    # and in AutoRound's solver steps, on the threads of --jobs 2 (GroupInputs.map) or in this process
    "autoround-bf16": {"group_size": 32, "calibration_matmul": "bf16", "iters": 10},
}


# ------------------------------------------------------------------------------------------- Observer.merge


def _activations(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_t(3, size=(600, 16)).astype(np.float32)


@pytest.mark.parametrize("kind", ["minmax", "percentile", "kl"])
def test_observer_merge_equals_one_observer_of_all_batches(kind: str) -> None:
    x = _activations(0)
    top = float(np.abs(x).max())  # the range given up front, as int8 calibration does
    whole = Observer(kind, 99.9, range_max=top)
    for chunk in np.array_split(x, 6):
        whole.add(chunk)
    for order in ([0, 1, 2], [2, 0, 1]):
        parts = [Observer(kind, 99.9, range_max=top) for _ in range(3)]
        for i, chunk in enumerate(np.array_split(x, 6)):
            parts[i % 3].add(chunk)
        merged = Observer(kind, 99.9, range_max=top)
        for i in order:
            merged.merge(parts[i])
        merged.merge(Observer(kind, 99.9, range_max=top))  # an observer that saw nothing changes nothing
        assert merged.count == whole.count and merged.absmax == whole.absmax
        np.testing.assert_array_equal(merged.channel_absmax, whole.channel_absmax)
        if kind != "minmax":
            assert merged.hist is not None and whole.hist is not None
            np.testing.assert_array_equal(merged.hist, whole.hist)
        assert merged.threshold() == whole.threshold()


def test_observer_merge_aligns_ranges_and_refuses_mismatches() -> None:
    x = _activations(1)
    small, large = Observer("kl", range_max=1.0), Observer("kl", range_max=4.0)
    small.add(np.clip(x[:300], -1, 1))
    large.add(np.clip(x[300:], -4, 4))
    small.merge(large)
    assert small.range == 4.0 and small.hist is not None and small.hist.sum() == x.size
    with pytest.raises(TopqError, match="cannot merge histograms"):
        odd = Observer("kl", range_max=3.0)
        odd.add(np.clip(x, -3, 3))
        small.merge(odd)
    with pytest.raises(TopqError, match="cannot merge a minmax observer"):
        small.merge(Observer("minmax"))


# ------------------------------------------------------------------------------------------- conversions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    """A tiny Qwen2 checkpoint and token-id calibration data beside it."""
    root = tmp_path_factory.mktemp("calib_exec")
    tiny_checkpoint("qwen2", root / "model")
    text = (AUSTEN / "00_EMMA.txt").read_bytes()
    (root / "emma.ids").write_text(" ".join(str(b) for b in text[:6000]))
    return root


def _recipe(root: Path, scheme: str, out: Path, data: bool = True, **quant: Any) -> Any:
    from topq.core.recipe import recipe_from_defaults

    calibration = {"data": str(root / "emma.ids") if data else None, **CALIBRATION}
    return recipe_from_defaults(model={"path": str(root / "model")},
                                quant={"scheme": scheme, **quant, "calibration": calibration},
                                target={"chip": "host"}, stages=STAGES, output={"path": str(out)})


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    """One local Ray instance for this module's Ray conversions (started by the first one, as in test_scale)."""
    import ray  # a test dependency: scripts/setup.sh installs topq[ray]

    yield
    ray.shutdown()


@pytest.mark.parametrize("scheme", ["gptq", "awq", "int8", "gptq-bf16", "autoround-bf16"])
def test_calibrated_bundles_are_identical_for_every_executor(tiny: Path, tmp_path: Path, scheme: str,
                                                             ray_instance: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--jobs 1, --jobs 2 (the layer loop's tasks and solver candidates on threads) and Ray give the same bytes,
    calibration included.

    The Ray run also proves its unit workers do not calibrate again: as soon as the converting process has read
    the calibration data, the file is moved away, so a worker that re-ran `prepare`'s calibration (instead of
    loading the stored result) would fail with "calibration data not found"."""
    from topq.core.pipeline import convert
    from topq.quant import calibration

    out = tmp_path / "model.topq"
    recipe = _recipe(tiny, scheme.removesuffix("-bf16"), out, **QUANT[scheme])
    summaries, contents = [], []
    for kwargs in ({"jobs": 1}, {"jobs": 2}):
        summaries.append(convert(recipe, progress=False, **kwargs))
        contents.append(out.read_bytes())

    data = tiny / "emma.ids"
    hidden = tiny / "emma.ids.hidden"
    read_windows = calibration.calibration_windows
    reads = []

    def read_once(model: Any, recipe: Any, progress: bool = True) -> np.ndarray:
        windows = read_windows(model, recipe, progress)
        reads.append(os.getpid())
        data.rename(hidden)  # nobody may read the calibration data after this
        return windows

    monkeypatch.setattr(calibration, "calibration_windows", read_once)
    try:
        summaries.append(convert(recipe, progress=False, jobs=2, executor="ray", use_cache=True,
                                 cache_dir=tmp_path / "cache"))
        contents.append(out.read_bytes())
    finally:
        if hidden.exists():
            hidden.rename(data)
    assert reads == [os.getpid()]  # calibrated once, here
    assert [s["executor"] for s in summaries] == ["inline", "local", "ray"]
    assert contents[0] == contents[1] == contents[2]
    assert summaries[0]["quant_report"] and summaries[0]["quant_report"] == summaries[2]["quant_report"]
    assert not list((tmp_path / "cache" / "calibration").iterdir())  # the stored result is removed afterwards


def test_calibration_result_store_round_trip(tmp_path: Path) -> None:
    from topq.quant.calibration import (
        CalibrationResult,
        load_calibration,
        save_calibration,
    )
    from topq.quant.grid import quantize_groups

    w = np.random.default_rng(3).normal(size=(8, 64)).astype(np.float32)
    result = CalibrationResult()
    result["a"] = quantize_groups(w, 4, 32, False)
    result["b"] = quantize_groups(w, 8, 64, True)
    result["b"].g_idx = np.arange(64, dtype=np.int32) // 64
    result.float_weights["norm"] = w[0]
    result.report = [{"name": "a", "error": np.float32(0.25), "rtn_error": 0.5, "ratio": 0.1 + 0.2}]
    result.state = {"plan": "x: 1\n"}
    save_calibration(result, tmp_path / "c.safetensors")
    loaded = load_calibration(tmp_path / "c.safetensors")
    assert list(loaded) == ["a", "b"]
    for name in loaded:
        for field in ("codes", "scales", "zeros", "g_idx"):
            a, b = getattr(result[name], field), getattr(loaded[name], field)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
        assert loaded[name].spec == result[name].spec
    np.testing.assert_array_equal(loaded.float_weights["norm"], w[0])
    assert loaded.report == [{"name": "a", "error": 0.25, "rtn_error": 0.5, "ratio": 0.1 + 0.2}]
    assert loaded.state == result.state
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "c.safetensors").read_bytes()[:100])
    with pytest.raises(TopqError):
        load_calibration(tmp_path / "other.safetensors")


def test_two_argument_calibrate_keeps_working() -> None:
    """The executor reaches only a calibrate that declares it; third-party two-argument hooks still run."""
    from topq.core.executors import InlineExecutor
    from topq.core.pipeline import calibrate_scheme
    from topq.core.quant import QuantScheme

    seen: list[Any] = []
    executor = InlineExecutor()
    old = QuantScheme("old", "", calibrate=lambda model, recipe: seen.append("two arguments") or {})
    new = QuantScheme("new", "", calibrate=lambda model, recipe, *, executor=None: seen.append(executor) or {})
    assert calibrate_scheme(None, None, old, executor) == {}  # type: ignore[arg-type]
    assert calibrate_scheme(None, None, new, executor) == {}  # type: ignore[arg-type]
    assert seen == ["two arguments", executor]


# ------------------------------------------------------------------------------------------- RTN report


def _decoder_linears(num_layers: int = 2) -> set[str]:
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    return {f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in names}


def test_rtn_reports_the_output_error_per_linear(tiny: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from topq.core.bundle import Bundle
    from topq.core.cli import main
    from topq.core.pipeline import convert

    errors: dict[str, dict[str, float]] = {}
    for scheme in ("w8bf16", "w4bf16"):
        out = tmp_path / f"{scheme}.topq"
        recipe_file = tmp_path / f"{scheme}.yaml"
        recipe_file.write_text(
            f"model: {{path: {tiny / 'model'}}}\n"
            f"quant: {{scheme: {scheme}, group_size: 32, calibration: {{data: {tiny / 'emma.ids'}, samples: 6, "
            f"seq_len: 16}}}}\ntarget: {{chip: host}}\nstages: {{seq_length: 32, max_input_length: 16}}\n"
            f"output: {{path: {out}}}\n")
        assert main(["convert", str(recipe_file), "--jobs", "2", "--no-cache", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["quant_report"]
        assert {row["name"] for row in report} == _decoder_linears() and len(report) == 14
        assert all(row["error"] > 0 for row in report)
        assert Bundle(out).meta["quant_report"] == report
        assert main(["inspect", str(out), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["quant_report"] == report
        errors[scheme] = {row["name"]: row["error"] for row in report}
        if scheme == "w4bf16":  # the same report from this process alone
            inline = convert(_recipe(tiny, scheme, tmp_path / "inline.topq", group_size=32), progress=False, jobs=1)
            assert inline["quant_report"] == report
    assert all(errors["w8bf16"][n] < errors["w4bf16"][n] for n in errors["w4bf16"])

    without = convert(_recipe(tiny, "w4bf16", tmp_path / "plain.topq", data=False, group_size=32), progress=False)
    assert without["quant_report"] == []


@pytest.mark.parametrize("scheme", ["gptq", "int8"])
def test_convert_without_progress_shows_no_bars(tiny: Path, tmp_path: Path, scheme: str,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    """`convert(progress=False)` hides every bar, the calibration's on the layer loop's threads included; with
    progress the same conversion shows them (so the first assertion could fail)."""
    from topq.core.pipeline import convert

    recipe = _recipe(tiny, scheme, tmp_path / "model.topq", **QUANT[scheme])
    convert(recipe, progress=False, jobs=2)
    quiet = capfd.readouterr().err
    convert(recipe, progress=True, jobs=2)
    shown = capfd.readouterr().err
    # every tqdm bar draws a "…%|████|" frame; the calibration's bar is named after its scheme
    assert "%|" in shown and scheme in shown
    assert "%|" not in quiet, quiet
