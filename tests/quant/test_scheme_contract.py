"""The scheme contract: a third-party scheme with its own option converts and runs on host and bm1684x with no
core or target edit; its options join the recipe schema (did-you-mean, `topq plugins --json`); option clashes
stop plugin loading; targets refuse what they cannot store, naming it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from host_bundles import TinyCheckpoint

import topq
import topq.core.plugins
from topq.core.bundle import Bundle
from topq.core.cli import main
from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.core.plugins import build_plugins
from topq.core.quant import Option, QuantizedWeight, QuantScheme, SchemeProduct
from topq.core.recipe import Field, load_recipe, recipe_from_defaults
from topq.core.runtime import Session
from topq.core.target import Target, float_only
from topq.ir.types import round_to_dtype
from topq.quant.options import GROUP_SIZE

IDS = [1, 5, 9, 77, 120, 3, 44, 200]
STAGES = {"seq_length": 64, "max_input_length": 16}
ROUNDING = Option("rounding", Field("str", "nearest", choices=("nearest", "floor"),
                                    help="test-rounder: how weights round to their 4-bit codes"))


# ---------------------------------------------------------------------------------------- the throwaway plugin


def rounder_quantize(weight: np.ndarray, options: Mapping[str, Any]) -> QuantizedWeight:
    """Asymmetric 4-bit group-wise codes, rounded as `quant.rounding` says; scales in bf16 (the compute dtype)."""
    n, k = weight.shape
    group = int(options["group_size"])
    groups = np.asarray(weight, np.float32).reshape(n, k // group, group)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scale = np.asarray(round_to_dtype(np.maximum(hi - lo, 1e-8) / 15, "bf16"), np.float32)
    zero = np.clip(np.rint(-lo / scale), 0, 15)
    rounding = {"nearest": np.rint, "floor": np.floor}[options["rounding"]]
    codes = np.clip(rounding(groups / scale[..., None]) + zero[..., None], 0, 15)
    return QuantizedWeight(codes.reshape(n, k).astype(np.uint8), scale, zero.astype(np.float32), 4, group, False)


ROUNDER = QuantScheme("test-rounder", "a third-party 4-bit scheme with its own rounding option", compute_dtype="bf16",
                      weight_bits=4, options=(GROUP_SIZE, ROUNDING), quantize=rounder_quantize)


class RounderPlugin:
    @topq.hookimpl
    def register_quant_schemes(self, register: Callable[[QuantScheme], None]) -> None:
        register(ROUNDER)


@pytest.fixture
def with_rounder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's plugins, plus the throwaway scheme: what an installed entry point would give."""
    monkeypatch.setattr(topq.core.plugins, "_PLUGINS", build_plugins(extra=(RounderPlugin(),)))
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("rounder")
    tiny_checkpoint("llama", d)
    return d


def convert_rounder(checkpoint: Path, out: Path, chip: str, rounding: str = "nearest",
                    scheme: str = "test-rounder") -> Bundle:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, target={"chip": chip}, stages=STAGES,
                                  quant={"scheme": scheme, "group_size": 32, "rounding": rounding},
                                  output={"path": str(out)})
    convert(recipe, progress=False)
    return Bundle(out)


# ---------------------------------------------------------------------------------------- converts and runs


def test_third_party_scheme_runs_on_host_and_bm1684x(with_rounder: None, tiny: Path, tmp_path: Path) -> None:
    host = convert_rounder(tiny, tmp_path / "host.topq", "host")
    chip = convert_rounder(tiny, tmp_path / "chip.topq", "bm1684x")
    # The chip packed the scheme's integers as A16 weights (no target edit knows this scheme)...
    assert "model.layers.0.mlp.down_proj.weight.packed" in chip.tensor_names()
    assert chip.meta["target_meta"]["mode"] == "test-rounder" and chip.meta["target_meta"]["dtype"] == "bf16"
    assert "tpu.A16MatMul" in chip.meta["target_meta"]["op_counts"]
    # The performance model reads the mode from the compiled program (W4, bf16), not from the scheme's name.
    target = topq.core.plugins.get_plugins().targets.get("bm1684x")
    rtn = convert_rounder(tiny, tmp_path / "rtn.topq", "bm1684x", scheme="w4bf16")  # the same layout, by name
    predicted, by_name = target.report(chip)["predicted"], target.report(rtn)["predicted"]
    assert predicted.pop("quant") == "test-rounder" and by_name.pop("quant") == "w4bf16"
    assert predicted == by_name
    # ... and computes what the host computes with the same integers.
    a, b = Session(host).feed(IDS, all_logits=True), Session(chip).feed(IDS, all_logits=True)
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999
    # The host stores the dequantized codes: exactly what rounder_quantize gives for the checkpoint's weight.
    name = "model.layers.1.self_attn.q_proj.weight"
    from topq.plugins.formats.hf import open_checkpoint  # the checkpoint's float weight

    expected = rounder_quantize(open_checkpoint(tiny).weights.get(name), {"group_size": 32, "rounding": "nearest"})
    np.testing.assert_array_equal(np.asarray(host.tensor(name)), expected.dequantize())


def test_the_schemes_own_option_reaches_it_and_is_stored(with_rounder: None, tiny: Path, tmp_path: Path) -> None:
    nearest = convert_rounder(tiny, tmp_path / "n.topq", "host")
    floor = convert_rounder(tiny, tmp_path / "f.topq", "host", rounding="floor")
    assert nearest.recipe["quant"]["rounding"] == "nearest" and floor.recipe["quant"]["rounding"] == "floor"
    name = "model.layers.0.mlp.up_proj.weight"
    a, b = np.asarray(nearest.tensor(name)), np.asarray(floor.tensor(name))
    assert not np.array_equal(a, b)
    # floor never rounds up: its dequantized weights sit at or below nearest's, group by group on average
    assert float(b.mean()) < float(a.mean())


# ---------------------------------------------------------------------------------------- recipe schema


def test_unknown_option_of_the_scheme_suggests_it(with_rounder: None, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\nquant: {scheme: test-rounder, roundng: floor}\n")
    with pytest.raises(TopqError, match=r"^.*r\.yaml: unknown key quant\.roundng \(did you mean quant\.rounding\?\)$"):
        load_recipe(recipe)
    recipe.write_text("model: {path: m}\nquant: {scheme: test-rounder}\n")
    with pytest.raises(TopqError, match=r"^--set quant\.roundng=floor: unknown key quant\.roundng "
                                        r"\(did you mean quant\.rounding\?\)$"):
        load_recipe(recipe, ["quant.roundng=floor"])
    with pytest.raises(TopqError, match=r"quant\.rounding: expected one of nearest, floor; got 'ceil'"):
        load_recipe(recipe, ["quant.rounding=ceil"])
    assert load_recipe(recipe, ["quant.rounding=floor"]).quant.rounding == "floor"


def test_without_the_plugin_its_option_is_unknown(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\nquant: {rounding: floor}\n")
    with pytest.raises(TopqError, match=r"unknown key quant\.rounding"):
        load_recipe(recipe)


def test_builtin_schema_keeps_todays_quant_keys_and_defaults() -> None:
    quant = recipe_from_defaults(model={"path": "/m"}).to_dict()["quant"]
    assert quant == {
        "scheme": "f32", "bits": None, "group_size": 64, "symmetric": False, "lm_head": "bf16", "act_dtype": None,
        "calibration_matmul": "f32", "act_order": False, "damp": 0.01, "block_size": 128, "static_groups": False,
        "scale_search": "minmax",
        "clip": True, "iters": 200, "lr": None, "objective": "linear", "batch_size": None,
        "observer": "minmax", "percentile": 99.99, "smooth_alpha": None, "dynamic_tokens": False, "budget": None,
        "table": None, "expert_min_tokens": 16,
        "calibration": {"data": None, "samples": 128, "seq_len": 512, "seed": 0}}


def test_plugins_json_lists_each_schemes_options(with_rounder: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["scheme_options"]
    assert {"name": "rounding", "type": "str", "default": "nearest", "doc": ROUNDING.spec.help,
            "choices": ["nearest", "floor"], "nullable": False} in options["test-rounder"]
    assert {o["name"] for o in options["gptq"]} == {"bits", "group_size", "symmetric", "act_dtype",
                                                    "calibration_matmul", "act_order", "damp", "block_size",
                                                    "static_groups", "scale_search", "expert_min_tokens"}
    assert options["f32"] == []
    assert main(["plugins"]) == 0
    assert 'test-rounder: group_size (int, default 64), rounding (str, default "nearest")' in capsys.readouterr().out


class _Registers:
    def __init__(self, *schemes: QuantScheme) -> None:
        self.schemes = schemes

    @topq.hookimpl
    def register_quant_schemes(self, register: Callable[[QuantScheme], None]) -> None:
        for scheme in self.schemes:
            register(scheme)


def test_an_option_declared_differently_stops_plugin_loading() -> None:
    other = QuantScheme("test-other", "", options=(Option("group_size", Field("int", 128, ge=1, help="x")),))
    with pytest.raises(TopqError, match=r"^quant schemes '[\w-]+' and '[\w-]+' declare option 'group_size' "
                                        r"differently \(.*int, default 128, >= 1.*\)$"):
        build_plugins(extra=(_Registers(other),))
    same = QuantScheme("test-same", "", options=(GROUP_SIZE,))  # the same declaration is shared
    assert "test-same" in build_plugins(extra=(_Registers(same),)).schemes


def test_an_option_named_like_a_core_key_stops_plugin_loading() -> None:
    bad = QuantScheme("test-bad", "", options=(Option("lm_head", Field("str", "bf16", help="x")),))
    with pytest.raises(TopqError, match=r"^quant scheme 'test-bad': option 'lm_head' is a core quant key$"):
        build_plugins(extra=(_Registers(bad),))


# ---------------------------------------------------------------------------------------- targets choose by product


def test_the_product_follows_the_options() -> None:
    schemes = topq.core.plugins.get_plugins().schemes
    quant = recipe_from_defaults(model={"path": "/m"}).to_dict()["quant"]
    assert schemes.get("gptq").produces(quant) == SchemeProduct("bf16", (4,))
    assert schemes.get("gptq").produces({**quant, "act_dtype": "f16", "bits": 8}) == SchemeProduct("f16", (8,))
    assert schemes.get("w4f16").produces(quant) == SchemeProduct("f16", (4,))
    assert schemes.get("int8").produces(quant) == SchemeProduct("bf16", (8,), int8_activations=True)
    assert schemes.get("bf16").produces(quant) == SchemeProduct("bf16")


class _FloatTarget:
    """A third-party target that declares nothing: float schemes only (the default `Target.refuses`)."""

    @topq.hookimpl
    def register_targets(self, register: Callable[[Target], None]) -> None:
        host = topq.core.plugins.get_plugins().targets.get("host")
        register(Target("test-float", "float only", compile=host.compile, open=host.open))


def test_a_target_refuses_what_it_cannot_store_naming_it(monkeypatch: pytest.MonkeyPatch, tiny: Path,
                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(topq.core.plugins, "_PLUGINS", build_plugins(extra=(_FloatTarget(), RounderPlugin())))
    assert float_only(SchemeProduct("bf16", (), int8_activations=True)) == "int8 activations"

    def run(**quant: Any) -> None:
        convert(recipe_from_defaults(model={"path": str(tiny)}, target={"chip": "test-float"}, stages=STAGES,
                                     quant=quant, output={"path": str(tmp_path / "x.topq")}), progress=False)

    with pytest.raises(TopqError, match=r"^target test-float cannot run 4-bit quantized weights$"):
        run(scheme="test-rounder", group_size=32)
    with pytest.raises(TopqError, match=r"^target test-float cannot run 4-bit quantized weights$"):
        run(scheme="bf16", lm_head="w4bf16")  # the lm_head's scheme is checked too
    run(scheme="bf16")
    assert Bundle(tmp_path / "x.topq").target == "test-float"


# ---------------------------------------------------------------------------------------- observe / solve


class AbsMaxObserver:
    """A third party's own statistics: per-channel max |x| and the number of tokens seen."""

    def __init__(self, k: int) -> None:
        self.abs_max = np.zeros(k, np.float32)
        self.tokens = 0

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).reshape(-1, self.abs_max.size)
        self.abs_max = np.maximum(self.abs_max, np.abs(x).max(axis=0))
        self.tokens += x.shape[0]


def test_a_layer_wise_scheme_is_observe_plus_solve(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme written as `observe` + `solve` (no calibrate of its own) converts through topq's layer loop: its
    solver gets its own statistics of each quant group's input, over every calibration token, and its values are
    what the bundle computes with."""
    from topq.quant.calibration import calibration_scheme

    seen: list[tuple[int, int]] = []

    def solve(weight: np.ndarray, stats: AbsMaxObserver, options: Mapping[str, Any]) -> QuantizedWeight:
        seen.append((weight.shape[1], stats.tokens))
        # weights on inputs that were never large matter less: round them on a grid scaled by the input's reach
        reach = np.maximum(stats.abs_max / stats.abs_max.max(), 0.25)
        return rounder_quantize(weight * reach, {**options, "rounding": "nearest"})

    scheme = calibration_scheme("test-layerwise", "observe + solve", solve=solve, observe=AbsMaxObserver)
    assert scheme.solve is solve and scheme.observe is AbsMaxObserver and scheme.calibrate is not None

    class Plugin:
        @topq.hookimpl
        def register_quant_schemes(self, register: Callable[[QuantScheme], None]) -> None:
            register(scheme)

    monkeypatch.setattr(topq.core.plugins, "_PLUGINS", build_plugins(extra=(Plugin(),)))
    ids = tmp_path / "calib.ids"
    ids.write_text(" ".join(map(str, np.random.default_rng(0).integers(3, 256, 4 * 16))))
    recipe = recipe_from_defaults(model={"path": str(tiny)}, target={"chip": "host"}, stages=STAGES,
                                  quant={"scheme": "test-layerwise", "group_size": 32,
                                         "calibration": {"data": str(ids), "samples": 4, "seq_len": 16}},
                                  output={"path": str(tmp_path / "lw.topq")})
    convert(recipe, progress=False)
    bundle = Bundle(tmp_path / "lw.topq")
    # one solve per quant group (q/k/v, o, gate/up, down) per layer, each over all 4 × 16 calibration tokens
    assert seen == [(64, 64), (64, 64), (64, 64), (128, 64)] * 2
    assert bundle.recipe["quant"]["scheme"] == "test-layerwise"
    logits = Session(bundle).feed(IDS, all_logits=True)
    assert np.isfinite(logits).all()
    assert "model.layers.0.self_attn.q_proj.weight" in bundle.tensor_names()


def test_calibration_scheme_takes_one_solver() -> None:
    from topq.quant.calibration import calibration_scheme

    with pytest.raises(TopqError, match="one of solve= and group_solver="):
        calibration_scheme("x", "neither")
