"""The conversion pipeline: checkpoint + recipe → Top IR → target compile → bundle."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import topq
from topq.core.build import (
    BuildStats,
    Prepared,
    bundle_tensors,
    default_cache_dir,
    recipe_key,
    store_calibration,
    write_unit,
)
from topq.core.calibration_result import CalibrationResult, load_calibration
from topq.core.checkpoint import WEIGHT_STORE_METHODS, Checkpoint, CheckpointFormat, WeightStore
from topq.core.errors import TopqError
from topq.core.executors import TaskExecutor, make_executor
from topq.core.family import ModelFamily, ModelSpec, find_family
from topq.core.plugins import Plugins, get_plugins
from topq.core.progress import progress_bar, showing_progress
from topq.core.quant import Option, QuantizedWeight, QuantScheme, QuantSpec, SchemeProduct, resolve_group_size
from topq.core.recipe import Recipe
from topq.core.stages import StageConfig, build_program, layer_carries, rope_weights
from topq.core.target import CompileJob, Target, check_target_options
from topq.io.bundle import write_bundle
from topq.io.files import check_writable
from topq.ir.analysis import linear_weight_names  # re-exported: callers import it from here
from topq.ir.graph import Module
from topq.ir.printer import print_function
from topq.ir.types import ELEMENT_TYPES, round_to_dtype
from topq.ir.verifier import verify_module


def open_checkpoint(plugins: Plugins, path: str | Path, fmt: str = "auto") -> Checkpoint:
    path = Path(path)
    if not path.exists():
        raise TopqError(f"checkpoint not found: {path}")
    if fmt != "auto":
        return _checked(plugins.formats.get(fmt), path)
    for candidate in plugins.formats:
        if candidate.detect(path):
            return _checked(candidate, path)
    raise TopqError(f"{path}: not a checkpoint any format recognises "
                    f"(known formats: {', '.join(plugins.formats.names())})")


def _checked(fmt: CheckpointFormat, path: Path) -> Checkpoint:
    """The format's checkpoint, refused in one line when its weight store lacks part of the contract."""
    checkpoint = fmt.open(path)
    if not isinstance(checkpoint.weights, WeightStore):
        missing = [m for m in WEIGHT_STORE_METHODS if not hasattr(checkpoint.weights, m)]
        raise TopqError(f"checkpoint format {fmt.name}: its weight store lacks {', '.join(missing)} "
                        f"(derive it from topq.core.checkpoint.BaseWeightStore)")
    return checkpoint


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    family: ModelFamily
    spec: ModelSpec
    module: Module
    extra_weights: dict[str, np.ndarray]

    def weight(self, name: str) -> np.ndarray:
        if name in self.extra_weights:
            return self.extra_weights[name]
        return self.checkpoint.weights.get(name)

    def weight_in(self, name: str, dtype: str) -> np.ndarray:
        """The weight in a float storage dtype; read as stored when it already is that dtype."""
        store = self.checkpoint.weights
        target = ELEMENT_TYPES[dtype]
        if name not in self.extra_weights and store.dtype(name) == target.name:
            stored = store.read_raw(name)
            if stored is not None:
                return stored
        return round_to_dtype(self.weight(name), dtype).astype(target)


def load_model(recipe: Recipe, plugins: Plugins | None = None) -> LoadedModel:
    """Open the checkpoint and express it as a verified Top IR program."""
    plugins = plugins or get_plugins()
    checkpoint = open_checkpoint(plugins, recipe.model.path, recipe.model.format)
    family = find_family(plugins.families, checkpoint.config, recipe.model.family)
    spec = family.normalize(checkpoint.config)
    # From here on the model's tensors are the family's logical ones (fused projections split, ...).
    checkpoint = dataclasses.replace(checkpoint, weights=family.weights(spec, checkpoint.weights))
    stages = StageConfig.from_recipe(recipe.stages)
    shapes = {name: checkpoint.weights.shape(name) for name in checkpoint.weights.names()}
    try:
        module = build_program(spec, family, stages, shapes)
    except TopqError as exc:  # a missing or misshapen tensor: say which checkpoint
        raise TopqError(f"{checkpoint.path}: {exc}") from None
    if recipe.kernels:  # raw kernels: applied by the IR extension that offers it (the raw plugin)
        plugins.kernel_substitution()(module, [{"replace": k["replace"], "with": k["with"]} for k in recipe.kernels])
    verify_module(module)
    return LoadedModel(checkpoint, family, spec, module, rope_weights(spec, stages.seq_length))


@dataclass(eq=False)
class Quantizer:
    """Per weight: the quantized values a target should pack (None = keep it in the compute dtype), and their layout.

    Linears follow the scheme (calibrated solvers first, then the checkpoint's own values for a scheme that reads
    them (`QuantScheme.stored`, e.g. `auto`), then round-to-nearest). The lm_head (or the tied embedding used as
    lm_head) follows `quant.lm_head`: a float mode keeps it unquantized; a weight-only scheme name quantizes it with
    that scheme. Values are computed on demand and not kept, so a target can stream weights one at a time; the
    layout (`spec`) is cheap and cached.
    """

    model: LoadedModel
    scheme: QuantScheme
    lm_head_scheme: QuantScheme
    options: dict[str, Any]
    linear_names: frozenset[str]
    precomputed: CalibrationResult

    @property
    def lm_head_name(self) -> str:
        return self.model.family.global_weights["embed" if self.model.spec.tie_word_embeddings else "lm_head"]

    def _scheme_for(self, name: str) -> QuantScheme | None:
        if name not in self.linear_names:
            return None
        return self.lm_head_scheme if name == self.lm_head_name else self.scheme

    def values(self, name: str) -> QuantizedWeight | None:
        scheme = self._scheme_for(name)
        if scheme is None:
            return None
        if scheme is self.scheme and name in self.precomputed:
            return self.precomputed[name]
        if scheme is self.scheme and scheme.stored is not None:
            return scheme.stored(self.model.checkpoint.weights, name, self.options)
        if scheme.quantize is not None:
            return scheme.quantize(self.model.weight(name), self.options)
        return None

    def report(self) -> list[dict[str, Any]]:
        """Per quantized linear, the relative output error on the calibration inputs (calibrated schemes; RTN
        schemes when the recipe gives calibration data)."""
        return list(self.precomputed.report)

    @functools.cache  # noqa: B019 - one Quantizer per conversion
    def spec(self, name: str) -> QuantSpec | None:
        scheme = self._scheme_for(name)
        if scheme is None:
            return None
        if scheme is self.scheme and scheme.stored_spec is not None and name not in self.precomputed:
            return scheme.stored_spec(self.model.checkpoint.weights, name, self.options)
        bits = scheme.produces(self.options).weight_bits
        if scheme.quantize is not None and len(bits) == 1 and name not in self.precomputed:
            n, k = self.model.checkpoint.weights.shape(name)
            group_size = resolve_group_size(self.options.get("group_size", 64), k, name)
            return QuantSpec((n, k), bits[0], group_size, bool(self.options.get("symmetric", False)))
        q = self.values(name)
        return q.spec if q is not None else None


def _takes_executor(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "executor" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def calibrate_scheme(model: LoadedModel, recipe: Recipe, scheme: QuantScheme,
                     executor: TaskExecutor | None = None) -> CalibrationResult:
    """The scheme's calibration result (empty for schemes that do not calibrate). A scheme with `calibrate` gets
    the executor if its calibrate takes one (see QuantScheme); a weight-by-weight scheme (RTN) given calibration
    data gets the per-linear error report (`QuantScheme.error_report`)."""
    if scheme.calibrate is not None:
        if executor is not None and _takes_executor(scheme.calibrate):
            return CalibrationResult.of(scheme.calibrate(model, recipe, executor=executor))
        return CalibrationResult.of(scheme.calibrate(model, recipe))
    if (scheme.error_report is not None and scheme.quantize is not None and scheme.weight_bits
            and recipe.quant.calibration.data is not None):
        return CalibrationResult.of(scheme.error_report(model, recipe, scheme, executor))
    return CalibrationResult()


def make_quantizer(model: LoadedModel, recipe: Recipe, plugins: Plugins, linear_names: frozenset[str],
                   executor: TaskExecutor | None = None, calibration_file: str | None = None) -> Quantizer:
    """`calibration_file`: a result the converting process stored (`save_calibration`), used instead of
    calibrating again (a Ray worker)."""
    scheme = plugins.schemes.get(recipe.quant.scheme)
    if calibration_file is not None:
        precomputed = load_calibration(calibration_file)
        if scheme.restore is not None:
            scheme.restore(model, recipe, precomputed)
    else:
        precomputed = calibrate_scheme(model, recipe, scheme, executor)
    # Algorithms may rewrite float tensors too (AWQ folds its scales into the preceding norms and biases);
    # those replace the checkpoint's tensors for everything that follows.
    model.extra_weights.update(precomputed.float_weights)
    return Quantizer(model, scheme, plugins.schemes.get(recipe.quant.lm_head), recipe.to_dict()["quant"],
                     linear_names, precomputed)


def dump_ir(directory: Path, dialect: str, module_text: str | Module) -> None:
    """One .mlir file per function under DIRECTORY/DIALECT/."""
    from topq.ir.parser import parse_module

    module = parse_module(module_text) if isinstance(module_text, str) else module_text
    out = directory / dialect
    out.mkdir(parents=True, exist_ok=True)
    for function in module:
        (out / f"{function.name}.mlir").write_text(print_function(function))


def check_target_product(target: Target, product: SchemeProduct, lm_head: SchemeProduct) -> None:
    """Refuse, before any work, what the target cannot store: the scheme's product, and the weight bits of the
    lm_head's scheme (`quant.lm_head`), which computes in the model's dtype."""
    for what in (product, SchemeProduct(product.compute_dtype, lm_head.weight_bits)):
        problem = target.refuses(what)
        if problem is not None:
            raise TopqError(f"target {target.name} cannot run {problem}")


def warn_unused_options(options: Mapping[str, Any], declared: Sequence[Option],
                        schemes: Sequence[QuantScheme]) -> None:
    """One warning per `quant` option set away from its default that neither the scheme nor the lm_head's scheme
    reads (e.g. `act_order` with `w4bf16`): it would change nothing, which the user should know."""
    used = {o.name for s in schemes for o in s.options}
    for option in declared:
        if option.name not in used and options.get(option.name) != option.spec.default:
            print(f"warning: quant.{option.name} = {options.get(option.name)!r} does not apply to scheme "
                  f"{schemes[0].name} and is ignored", file=sys.stderr)


def prepare(recipe: Recipe, dump_dir: Path | None = None, executor: TaskExecutor | None = None,
            calibration_file: str | None = None) -> Prepared:
    """Load the model, decide quantization and compile the program (tensors are produced later, on demand).

    Calibration runs its per-sample tasks on `executor` (default: this process); with `calibration_file` the
    result stored there by the converting process is loaded instead."""
    plugins = get_plugins()
    scheme = plugins.schemes.get(recipe.quant.scheme)
    target = plugins.targets.get(recipe.target.chip)
    options = recipe.to_dict()["quant"]
    check_target_options(target, recipe.to_dict()["target"], plugins.target_options)
    product = scheme.produces(options)
    lm_head = plugins.schemes.get(recipe.quant.lm_head)
    check_target_product(target, product, lm_head.produces(options))
    model = load_model(recipe, plugins)
    if dump_dir is not None:
        dump_ir(Path(dump_dir), "top", model.module)
    linear_names = linear_weight_names(model.module)
    quantizer = make_quantizer(model, recipe, plugins, linear_names, executor, calibration_file)
    job = CompileJob(module=model.module, spec=model.spec, weights=model.weight, scheme=scheme,
                     weight_in=model.weight_in, quant_options=options, recipe=recipe.to_dict(),
                     linear_weights=linear_names,
                     quantized=quantizer.values, quant_spec=quantizer.spec, product=product)
    compiled = target.compile(job)
    if dump_dir is not None:
        dump_ir(Path(dump_dir), target.name, compiled.program)
    prepared = Prepared(model, compiled, recipe.to_dict(), quantizer.report(), quantizer.precomputed,
                        calibration_file)
    _remember(prepared)
    return prepared


#: conversions prepared in this process, by recipe key; forked workers inherit the parent's entry
_PREPARED: dict[str, Prepared] = {}


def _remember(prepared: Prepared) -> None:
    _PREPARED[recipe_key(prepared.recipe)] = prepared


def _prepared(recipe: dict[str, Any], calibration_file: str | None = None) -> Prepared:
    key = recipe_key(recipe)
    if calibration_file is not None:  # one conversion's calibration: a later one may calibrate differently
        key = f"{key}:{calibration_file}"
    if key not in _PREPARED:
        # A worker that did not fork from the parent (Ray): rebuild the same program, loading the parent's
        # calibration result (if any) instead of calibrating again.
        _PREPARED.clear()  # one conversion at a time per worker: do not keep earlier models alive
        _PREPARED[key] = prepare(Recipe.from_dict(recipe, source="<build task>"), calibration_file=calibration_file)
    return _PREPARED[key]


def compile_unit(recipe: dict[str, Any], names: list[str], out_path: str, calibration_file: str | None = None) -> str:
    """A build task (`build.UnitTask`): produce the tensors `names` and store them at `out_path` (atomically)."""
    return write_unit(_prepared(recipe, calibration_file), names, out_path)


def convert(recipe: Recipe, dump_dir: Path | None = None, progress: bool = True, jobs: int | None = 1,
            executor: str = "local", ray_address: str | None = None, cache_dir: Path | None = None,
            use_cache: bool = False) -> dict[str, Any]:
    """Run the whole conversion; return a JSON-able summary.

    `jobs` / `executor` choose where calibration tasks run and units compile (executors.py: one executor for
    both); with `use_cache` built units are kept in `cache_dir` (default ~/.cache/topq) and reused by later
    conversions.
    """
    started = time.perf_counter()
    phases = PhaseTimer()
    cache = (cache_dir or default_cache_dir()) if use_cache else None
    check_writable(Path(recipe.output.path), [("build cache", cache), ("--dump-ir", dump_dir)], "bundle file")
    with showing_progress(progress):  # every bar of the conversion, calibration's and plugins' included
        runner = make_executor(executor, jobs, ray_address)
        try:
            return _convert(recipe, dump_dir, runner, cache, started, phases)
        finally:
            runner.close()


def _convert(recipe: Recipe, dump_dir: Path | None, runner: TaskExecutor, cache_dir: Path | None, started: float,
             phases: PhaseTimer) -> dict[str, Any]:
    plugins = get_plugins()  # said once, by the converting process (workers that prepare again stay quiet)
    warn_unused_options(recipe.to_dict()["quant"], plugins.scheme_options,
                        (plugins.schemes.get(recipe.quant.scheme), plugins.schemes.get(recipe.quant.lm_head)))
    prepared = prepare(recipe, dump_dir, runner)
    phases.mark("prepare")
    for line in prepared.calibration.warnings:
        print(f"warning: {line}", file=sys.stderr)
    note = prepared.model.family.conversion_note
    if note is not None and (text := note(prepared.model.checkpoint.config)):
        print(f"note: {text}", file=sys.stderr)
    runner.refresh()  # workers forked during calibration predate the prepared program: units need fresh ones
    model, compiled = prepared.model, prepared.compiled
    stages = StageConfig.from_recipe(recipe.stages)
    meta = {
        "topq_version": topq.__version__,
        "target": recipe.target.chip,
        "scheme": recipe.quant.scheme,
        "program": compiled.program,
        "spec": model.spec.to_dict(),
        "family": model.family.name,
        # Where the bundle is written is not part of it: the same recipe gives the same bytes at any path.
        "recipe": {k: v for k, v in recipe.to_dict().items() if k != "output"},
        "tokenizer": model.checkpoint.tokenizer_files,
        "target_meta": compiled.metadata,
        "quant_report": prepared.quant_report,
        "stages": {"seq_length": stages.seq_length, "max_input_length": stages.max_input_length,
                   "prefill_kv": stages.prefill_kv, "decode_variants": list(stages.decode_variants),
                   **({"layer_states": carries} if any(carries := layer_carries(model.spec, model.family)) else {})},
    }
    output = Path(recipe.output.path)
    stats = BuildStats()
    # Workers that do not inherit this process (Ray) load the calibration result instead of recomputing it.
    stored = None if runner.shares_memory else store_calibration(prepared, cache_dir)
    try:
        manifest, tensors = bundle_tensors(prepared, runner, cache_dir, stats, compile_unit)
        runner.close()  # every unit is built; reaping the workers also counts their peak RSS in the phase report
        phases.mark("units")
        write_bundle(output, manifest, progress_bar(tensors, total=len(manifest), desc="write bundle", unit="tensor"),
                     meta)
        phases.mark("write")
    finally:
        if stored is not None:
            shutil.rmtree(stored, ignore_errors=True)
            prepared.calibration_file = None
    return {
        "output": str(output),
        "target": recipe.target.chip,
        "scheme": recipe.quant.scheme,
        "family": model.family.name,
        "functions": len(model.module.functions),
        "top_ops": model.module.num_ops(),
        "units": stats.units,
        "units_built": stats.built,
        "units_reused": stats.reused,
        "executor": runner.name,
        "quant_report": prepared.quant_report,
        "bytes": output.stat().st_size,
        "seconds": round(time.perf_counter() - started, 3),
        "phases": phases.phases,
    }


class PhaseTimer:
    """Wall and CPU seconds (this process and its finished children) between marks, plus peak RSS so far."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._wall, self._cpu = time.perf_counter(), self._cpu_now()

    @staticmethod
    def _cpu_now() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @staticmethod
    def _peak_rss_mib() -> float:
        """Peak RSS of this process (VmHWM: unlike ru_maxrss it does not inherit the spawning parent's peak)
        and of any single finished child."""
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    own = int(line.split()[1])
        except OSError:
            pass
        return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024  # KiB → MiB

    def mark(self, name: str) -> None:
        wall, cpu = time.perf_counter(), self._cpu_now()
        rss = self._peak_rss_mib()
        self.phases[name] = {"wall_s": round(wall - self._wall, 3), "cpu_s": round(cpu - self._cpu, 3),
                             "peak_rss_mib": round(rss, 1)}
        self._wall, self._cpu = wall, cpu
