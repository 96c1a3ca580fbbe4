"""The `int8` scheme (W8A8): per-channel int8 weights, per-tensor static or per-token dynamic int8 activations.

Pipeline (`calibrate(model, recipe)`, see docs/quantization.md):

1. sites: every decoder linear's input, grouped by the value it reads (q/k/v share one, gate/up share one; the
   down projection reads act(x Wgᵀ) * (x Wuᵀ), observed inside `top.MLP`);
2. the float model runs on the calibration windows (reference interpreter) and an observer per site records
   |x| (pass 1: per-channel absmax, enough for minmax and SmoothQuant; pass 2, percentile/kl only: a histogram
   of the smoothed input);
3. SmoothQuant (`smooth_alpha`): s_j = max|X_j|^α / max|W_j|^(1-α); W·s is quantized and 1/s is folded into the
   RMSNorm weight in front (q/k/v, gate/up), into the up projection's rows (down: h = act(g)·up is linear in up),
   or applied as an explicit `top.Mul` (o_proj);
4. the Top program is rewritten in place: int8 linears become `top.A8MatMul(x, w)` (int8 activations) and their
   values — per-channel symmetric int8 codes of the (smoothed) weight with bf16 scales — are the scheme's
   `QuantizedWeight`s, returned through the scheme contract like any scheme's, so each target stores them its
   own way (host: codes and scales for `top.MatMulInt8`; bm1684x: i8 codes and requantization multipliers);
   the float tensors smoothing changes (folded norms, smoothed bf16 linears, 1/s factors) are the result's
   `float_weights`; a `top.MLP` is split where any of its linears is int8;
5. `budget`: greedy mixed precision — linears go back to BF16, most damaging first, until the held-out
   perplexity is within budget × the BF16 model's.

The result (modes, activation scales, smoothing factors) is the calibration table: written to `quant.table`
(YAML) when that file does not exist, loaded from it — without calibration data — when it does, and always
recorded in the program's module attribute `topq.int8` (so in the bundle metadata).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import topq
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.progress import progress_bar
from topq.core.quant import Option, QuantizedWeight, QuantScheme, SchemeProduct
from topq.core.recipe import Field
from topq.core.stages import rope_weights
from topq.io.files import atomic_file
from topq.ir.analysis import LinearUse, op_linears, weight_name
from topq.ir.catalogue import Linear, traits_of
from topq.ir.graph import Function, Module, Operation, Value
from topq.ir.int8 import QMAX, quantize_weight
from topq.ir.interpreter import Interpreter, Step
from topq.ir.reference_ops import REFERENCE_OPS, mlp_down, mlp_hidden
from topq.ir.rewrite import Rewriter, apply_patterns
from topq.ir.sampling import head_nll
from topq.ir.threads import blas_threads, fixed_threads
from topq.ir.types import ELEMENT_TYPES, TensorType, round_to_dtype
from topq.quant.memory import keep_freed_memory
from topq.quant.observers import Observer
from topq.quant.program import ProgramSource, build_calibration_program, open_weights, program_source
from topq.quant.sites import MLP_HIDDEN, shared_input_sites
from topq.quant.spill import Spill, move_quantized, release, spill_directory

OPTIONS = (
    Option("observer", Field("str", "minmax", choices=("minmax", "percentile", "kl"),
                             help="int8: activation range observer")),
    Option("percentile", Field("float", 99.99, gt=0, le=100, help="int8: percentile for the percentile observer")),
    Option("smooth_alpha", Field("float", None, nullable=True, ge=0, le=1,
                                 help="int8: SmoothQuant migration strength; null = off")),
    Option("dynamic_tokens", Field("bool", False, help="int8: per-token dynamic activation scales")),
    Option("budget", Field("float", None, nullable=True, ge=0,
                           help="int8: mixed-precision perplexity budget; null = all int8")),
    Option("table", Field("str", None, nullable=True, path=True, help="int8: per-layer mode file")),
)
TABLE_VERSION = 1
OUT = ":out"  # observer key suffix of a linear's output (static requantization's out_scale)
SCALE_DTYPE = "bf16"  # weight scales are stored (and multiplied) in the compute dtype


# ============================================================================ options and the plan


@dataclass(frozen=True)
class Int8Options:
    observer: str
    percentile: float
    smooth_alpha: float | None
    dynamic: bool
    budget: float | None
    table: str | None

    @classmethod
    def from_recipe(cls, recipe: Any) -> Int8Options:
        q = recipe.quant
        observer = str(q.observer)
        if observer not in ("minmax", "percentile", "kl"):
            raise TopqError(f"unknown quant.observer {observer!r}; known: minmax, kl, percentile")
        budget = None if q.budget is None else float(q.budget)
        if budget is not None and budget < 1:
            raise TopqError(f"quant.budget is a perplexity ratio to the float model and must be >= 1, got {budget}")
        return cls(observer, float(q.percentile), None if q.smooth_alpha is None else float(q.smooth_alpha),
                   bool(q.dynamic_tokens), budget, None if q.table is None else str(q.table))


@dataclass
class Site:
    """One linear input: the linears reading it, and where SmoothQuant's 1/s goes."""

    names: tuple[str, ...]
    kind: str  # "input" (operand 0 of the linears) or "mlp_hidden" (the down projection's input inside top.MLP)
    k: int
    fold: str  # "norm": divide the RMSNorm weight `fold_weight`; "up": divide up's rows; "mul": explicit top.Mul
    fold_weight: str | None = None

    @property
    def key(self) -> str:
        return self.names[0]


@dataclass
class Int8Plan:
    """Everything the rewrite needs (= the calibration table)."""

    modes: dict[str, str]  # linear weight name → "int8" | "bf16"
    act_scales: dict[str, float]  # linear weight name → static activation scale (T / 127)
    act_absmax: dict[str, float]
    smooth: dict[str, np.ndarray] = field(default_factory=dict)  # site key → s [K]
    info: dict[str, Any] = field(default_factory=dict)
    out_scales: dict[str, float] = field(default_factory=dict)  # static: linear → output scale (requantization)

    def to_yaml(self) -> str:
        doc = {"version": TABLE_VERSION, "scheme": "int8", **self.info,
               "layers": {n: {"mode": self.modes[n], "act_scale": self.act_scales[n],
                              "act_absmax": self.act_absmax[n],
                              **({"out_scale": self.out_scales[n]} if n in self.out_scales else {})}
                          for n in self.modes},
               "smooth": {k: [float(x) for x in v] for k, v in self.smooth.items()}}
        return yaml.safe_dump(doc, sort_keys=False, width=120)

    @classmethod
    def from_yaml(cls, text: str, source: str) -> Int8Plan:
        try:
            doc = yaml.safe_load(text)
            if not isinstance(doc, dict) or doc.get("version") != TABLE_VERSION or doc.get("scheme") != "int8":
                raise TopqError(f"{source}: not an int8 calibration table (version {TABLE_VERSION})")
            layers = doc["layers"]
            modes = {n: str(v["mode"]) for n, v in layers.items()}
            bad = [n for n, m in modes.items() if m not in ("int8", "bf16")]
            if bad:
                raise TopqError(f"{source}: {bad[0]}: mode must be int8 or bf16, got {modes[bad[0]]!r}")
            info = {k: v for k, v in doc.items() if k not in ("version", "scheme", "layers", "smooth")}
            return cls(modes, {n: float(v["act_scale"]) for n, v in layers.items()},
                       {n: float(v.get("act_absmax", 0.0)) for n, v in layers.items()},
                       {k: np.asarray(v, dtype=np.float32) for k, v in (doc.get("smooth") or {}).items()}, info,
                       {n: float(v["out_scale"]) for n, v in layers.items() if "out_scale" in v})
        except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TopqError(f"{source}: malformed int8 calibration table ({type(exc).__name__}: {exc})") from None


# ============================================================================ the graph side


def _accepts(linears: frozenset[str]) -> Callable[[LinearUse], bool]:
    """The linears int8 plans: the given weights, stored [N, K] and 2-D."""
    return lambda use: (use.weight in linears and use.hf_layout
                        and len(use.op.operands[use.linear.weight].shape) == 2)


def find_sites(function: Function, linears: frozenset[str]) -> tuple[list[Site], dict[int, list[Site]]]:
    """The sites of one block function and, per op id, the sites observed when that op runs.

    SmoothQuant's 1/s goes into an RMSNorm-like weight (a norm without bias) when x is that norm's output and
    feeds only the site's linears; into up's rows for the down projection; else an explicit top.Mul."""
    sites: list[Site] = []
    at_op: dict[int, list[Site]] = {}
    for found in shared_input_sites(function, _accepts(linears)):
        if found.kind == MLP_HIDDEN:
            assert found.fold is not None
            fold, fold_weight = "up", found.fold.weight
        elif found.fold is not None:
            fold, fold_weight = "norm", found.fold.weight
        else:
            fold, fold_weight = "mul", None
        site = Site(found.names, found.kind, found.k, fold, fold_weight)
        sites.append(site)
        at_op.setdefault(id(found.op), []).append(site)
    return sites, at_op


# ============================================================================ observing the float model


class _ObserveInterpreter(Interpreter):
    """The reference interpreter whose tap feeds each site's input (divided by its smoothing factor) to an
    observer, and each linear's output to its `<weight>:out` observer when there is one."""

    def __init__(self, module: Module, weights: Callable[[str], np.ndarray], at_op: dict[int, list[Site]],
                 observers: dict[str, Observer], inv_smooth: Mapping[str, np.ndarray]) -> None:
        super().__init__(module, weights, tap=self._observe)
        self.at_op, self.observers, self.inv_smooth = at_op, observers, inv_smooth

    def run_op(self, step: Step, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """A top.MLP whose down projection is a site computes its act once, for the observers and for its result
        (`mlp_hidden` then `mlp_down`, of which the op's own kernel is made: the same bits)."""
        site = next((s for s in self.at_op.get(id(step.op), ()) if s.kind == MLP_HIDDEN), None)
        if site is None:
            return step.kernel(inputs, step.attrs)
        x, wg, wu, wd = (np.asarray(a, dtype=np.float32) for a in inputs)
        gate, up, act = mlp_hidden(x, wg, wu, str(step.attrs.get("act", "silu")))
        self._observe_output(step.op.operands[1], gate)
        self._observe_output(step.op.operands[2], up)
        self._observe_site(site, act)
        return [mlp_down(act, wd).reshape(x.shape)]

    def _observe(self, step: Step, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for site in self.at_op.get(id(step.op), ()):
            if site.kind != MLP_HIDDEN:  # those are observed in run_op
                self._observe_site(site, inputs[0])
        result = _result_linear(step.op)
        if result is not None:
            self._observe_output(step.op.operands[result.weight], outputs[0])

    def _observe_site(self, site: Site, x: np.ndarray) -> None:
        inv = self.inv_smooth.get(site.key)
        self.observers[site.key].add(x if inv is None else x * inv)

    def _observe_output(self, weight: Value, y: np.ndarray) -> None:
        """Static requantization needs each linear's output range: observers keyed `<weight>:out`, when asked."""
        name = weight_name(weight)
        observer = self.observers.get(f"{name}{OUT}") if name is not None else None
        if observer is not None:
            observer.add(y)


def _result_linear(op: Operation) -> Linear | None:
    """The linear whose output is the op's result: a plain linear op's own; in a fused op (top.MLP) the one that
    reads the activation computed inside it (down)."""
    linears = traits_of(op.name).linears
    if len(linears) == 1:
        return linears[0]
    return next((linear for linear in linears if linear.input is None), None)


@dataclass
class _CalibModel:
    module: Module
    sites: list[Site]
    at_op: dict[int, list[Site]]
    weights: Callable[[str], np.ndarray]
    seq_len: int
    source: ProgramSource  # how a worker sharing no memory rebuilds it (the checkpoint is read by path)
    linears: frozenset[str]


def _calib_model(model: Any, seq_len: int, linears: frozenset[str]) -> _CalibModel:
    source = program_source(model, seq_len)
    module, _, _ = build_calibration_program(source, model.family, model.spec)  # fresh: mixed precision rewrites it
    return _sites_of(module, source, model.spec, model.checkpoint.weights, linears)


def _sites_of(module: Module, source: ProgramSource, spec: Any, store: Any, linears: frozenset[str]) -> _CalibModel:
    rope = rope_weights(spec, source.seq_len)
    sites: list[Site] = []
    at_op: dict[int, list[Site]] = {}
    for i in range(spec.num_layers):
        s, a = find_sites(module[f"block_{i}"], linears)
        sites += s
        at_op.update(a)
    return _CalibModel(module, sites, at_op, lambda n: rope[n] if n in rope else store.get(n), source.seq_len, source,
                       linears)


@dataclass
class _ObserveJob:
    """What `_observe_task` needs: the float model — the parent's interpreter where tasks share its memory, else
    how to rebuild it (`_CalibModel.source` and its linears: the checkpoint is read by path, as Ray unit workers
    do) — and, per site, the configuration of the fresh observers a task fills (kind, percentile, bins, range)."""

    interp: _ObserveInterpreter | None
    source: tuple[ProgramSource, frozenset[str]] | None
    num_layers: int
    observers: dict[str, tuple[str, float, int, float]]
    inv_smooth: Mapping[str, np.ndarray]


_SOURCE_INTERP: dict[Any, _ObserveInterpreter] = {}  # a worker's float model, by source (its weights stay loaded)


def _source_interp(source: ProgramSource, linears: frozenset[str]) -> _ObserveInterpreter:
    key = (source.key, source.checkpoint, source.format, linears)
    interp = _SOURCE_INTERP.get(key)
    if interp is None:
        module, _, spec = build_calibration_program(source)
        cm = _sites_of(module, source, spec, open_weights(source), linears)
        _SOURCE_INTERP.clear()  # one model at a time
        interp = _SOURCE_INTERP[key] = _ObserveInterpreter(cm.module, cm.weights, cm.at_op, {}, {})
    return interp


def _observe_task(job_handle: Any, windows: np.ndarray) -> dict[str, Observer]:
    """An observation task: run the float model on `windows`; return each site's observer of just these windows."""
    from topq.core.executors import resolve

    job: _ObserveJob = resolve(job_handle)
    if job.interp is not None:
        interp = job.interp
    else:
        assert job.source is not None
        interp = _source_interp(*job.source)
    observers = {key: Observer(kind, percentile, bins, range_max=top or None)
                 for key, (kind, percentile, bins, top) in job.observers.items()}
    interp.observers, interp.inv_smooth = observers, job.inv_smooth
    positions = np.arange(int(windows.shape[1]), dtype=np.int32)[None]
    for w in windows:
        h = interp.run("embedding", [w[None].astype(np.int32)])[0]
        for i in range(job.num_layers):
            h = interp.run(f"block_{i}", [h, positions])[0]
    return observers


def _run_float(cm: _CalibModel, interp: _ObserveInterpreter, windows: np.ndarray, num_layers: int, desc: str,
               executor: Any = None) -> None:
    """Run the float model on every window and feed `interp`'s observers. The windows are split into tasks on
    `executor` (default: this process); each returns partial observers, merged here (maxima and integer counts:
    the same result whatever ran the tasks and however the windows were split)."""
    from topq.core.executors import InlineExecutor

    executor = executor if executor is not None else InlineExecutor()
    targets = interp.observers
    configs = {key: (o.kind, o.percentile, o.bins, o.range) for key, o in targets.items()}
    if executor.shares_memory:
        for name in ("embedding", *(f"block_{i}" for i in range(num_layers))):
            interp.plan(cm.module[name])  # load the weights once here: forked workers share them (copy-on-write)
        job = _ObserveJob(interp, None, num_layers, configs, interp.inv_smooth)
    else:
        job = _ObserveJob(None, (cm.source, cm.linears), num_layers, configs, interp.inv_smooth)
    inline = isinstance(executor, InlineExecutor)
    chunk = 1 if inline else max(1, math.ceil(len(windows) / (4 * max(1, int(executor.jobs)))))
    starts = range(0, len(windows), chunk)
    inv_smooth = interp.inv_smooth
    handle = executor.share(job)
    bar = progress_bar(total=len(windows), desc=desc, unit="sample", disable=len(windows) < 2)
    try:
        tasks = [(handle, np.ascontiguousarray(windows[a:a + chunk])) for a in starts]
        for a, partial in zip(starts, executor.map(_observe_task, tasks)):
            for key, observer in partial.items():
                targets[key].merge(observer)
            bar.update(min(chunk, len(windows) - a))
    finally:
        bar.close()
        executor.release(handle)
        interp.observers, interp.inv_smooth = targets, inv_smooth


def calibrate_plan(model: Any, windows: np.ndarray, linears: frozenset[str], opts: Int8Options,
                   executor: Any = None) -> tuple[Int8Plan, _CalibModel]:
    """Observe the float model on `windows` and compute scales and smoothing factors for every site."""
    cm = _calib_model(model, windows.shape[1], linears)
    first = {site.key: Observer("minmax") for site in cm.sites}
    outputs = [] if opts.dynamic else [f"{n}{OUT}" for site in cm.sites for n in site.names]
    first.update({key: Observer("minmax") for key in outputs})
    observed = not opts.dynamic or opts.smooth_alpha is not None  # per-token scales alone need no statistics
    if observed:
        _run_float(cm, _ObserveInterpreter(cm.module, cm.weights, cm.at_op, first, {}), windows,
                   model.spec.num_layers, "int8 observe", executor)
    smooth: dict[str, np.ndarray] = {}
    if opts.smooth_alpha is not None:
        # down sites first: their factor rescales up's rows, which the gate/up site's weight maxima then see
        for site in sorted(cm.sites, key=lambda s: s.kind != "mlp_hidden"):
            w_max = np.max([np.abs(_effective(cm.weights, n, smooth, cm.sites)).max(axis=0) for n in site.names],
                           axis=0)
            smooth[site.key] = smooth_factors(first[site.key].channel_absmax, w_max, opts.smooth_alpha)  # type: ignore[arg-type]
    observers = first
    if opts.observer != "minmax" and not opts.dynamic:
        inv = {k: (1.0 / v).astype(np.float32) for k, v in smooth.items()}
        observers = {}
        for site in cm.sites:
            ch = first[site.key].channel_absmax
            assert ch is not None
            top = float((ch * inv[site.key]).max()) if site.key in inv else first[site.key].absmax
            observers[site.key] = Observer(opts.observer, opts.percentile, range_max=top or None)
        for key in outputs:
            observers[key] = Observer(opts.observer, opts.percentile, range_max=first[key].absmax or None)
        _run_float(cm, _ObserveInterpreter(cm.module, cm.weights, cm.at_op, observers, inv), windows,
                   model.spec.num_layers, f"int8 {opts.observer} histograms", executor)
    modes, scales, absmax = {}, {}, {}
    for site in cm.sites:
        obs = observers[site.key]
        if site.key in smooth and opts.observer == "minmax":
            ch = obs.channel_absmax
            assert ch is not None
            top = float((ch / smooth[site.key]).max())
        elif not observed:
            top = 0.0  # dynamic: the scale is each token's own; nothing static to record
        else:
            top = obs.threshold() if opts.observer != "minmax" and not opts.dynamic else obs.absmax
        top = top if top > 0 or not observed else 1.0
        for n in site.names:
            modes[n] = "int8"
            scales[n] = float(np.float32(top) / np.float32(QMAX))
            absmax[n] = float(top)
    out_scales = {}
    for key in outputs:  # static: every int8 linear requantizes its int32 sums to int8 with this output scale
        obs = observers[key]
        top = obs.threshold() if opts.observer != "minmax" else obs.absmax
        out_scales[key[: -len(OUT)]] = float(np.float32(top if top > 0 else 1.0) / np.float32(QMAX))
    info = {"observer": opts.observer, "percentile": opts.percentile, "smooth_alpha": opts.smooth_alpha,
            "dynamic_tokens": opts.dynamic, "samples": int(windows.shape[0]), "seq_len": int(windows.shape[1])}
    return Int8Plan(modes, scales, absmax, smooth, info, out_scales), cm


def smooth_factors(x_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per-input-channel s = max|X_j|^α / max|W_j|^(1-α) (1 where a channel is dead), float32."""
    x_max = np.asarray(x_max, dtype=np.float64)
    w_max = np.asarray(w_max, dtype=np.float64)
    alive = (x_max > 0) & (w_max > 0)
    s = np.ones_like(x_max)
    s[alive] = x_max[alive] ** alpha / w_max[alive] ** (1 - alpha)
    return np.clip(s, 1e-5, 1e5).astype(np.float32)


def _effective(weights: Callable[[str], np.ndarray], name: str, smooth: Mapping[str, np.ndarray],
               sites: list[Site]) -> np.ndarray:
    """The float weight a linear computes with after smoothing: up rows / s_down, then columns * s_site."""
    w = np.asarray(weights(name), dtype=np.float32)
    for site in sites:
        if site.fold == "up" and site.fold_weight == name and site.key in smooth:
            w = w / smooth[site.key][:, None]
        if name in site.names and site.key in smooth:
            w = w * smooth[site.key][None, :]
    return w.astype(np.float32)


# ============================================================================ rewriting the program


def int8_values(weights: Callable[[str], np.ndarray], plan: Int8Plan, sites: list[Site]) -> dict[str, QuantizedWeight]:
    """The scheme's values of its int8 linears: per output channel, symmetric int8 codes of the weight the linear
    computes with (smoothed) and the scale in SCALE_DTYPE (`topq.ir.int8.quantize_weight`)."""
    values = {}
    for name, mode in plan.modes.items():
        if mode == "int8":
            codes, scale = quantize_weight(_effective(weights, name, plan.smooth, sites), SCALE_DTYPE)
            n, k = codes.shape
            values[name] = QuantizedWeight(codes, scale[:, None], np.zeros((n, 1), np.float32), 8, k, True)
    return values


def float_rewrites(weights: Callable[[str], np.ndarray], plan: Int8Plan, sites: list[Site]) -> dict[str, np.ndarray]:
    """The float tensors the rewritten program reads instead of (or beside) the checkpoint's: smoothed linears
    kept in bf16 (`<w>.smoothed`), norm weights with 1/s folded in (under their own names), explicit 1/s
    factors (`<site>.smooth_inv`)."""
    out: dict[str, np.ndarray] = {}
    for name, mode in plan.modes.items():
        if mode != "int8" and _smoothed(name, plan, sites):
            out[f"{name}.smoothed"] = _effective(weights, name, plan.smooth, sites)
    for site in sites:
        s = plan.smooth.get(site.key)
        if s is None:
            continue
        if site.fold == "norm":
            assert site.fold_weight is not None
            out[site.fold_weight] = (np.asarray(weights(site.fold_weight), np.float32) / s).astype(np.float32)
        elif site.fold == "mul":
            out[f"{site.key}.smooth_inv"] = (1.0 / s).astype(np.float32)
    return out


def _smoothed(name: str, plan: Int8Plan, sites: list[Site]) -> bool:
    return any(s.key in plan.smooth and (name in s.names or (s.fold == "up" and s.fold_weight == name))
               for s in sites)


def rewrite_program(module: Module, plan: Int8Plan, sites: list[Site], dynamic: bool) -> None:
    """Replace the planned linears of every function (all stages) by int8 / smoothed bf16 ones, in place."""
    site_of = {n: s for s in sites for n in s.names}
    f32 = lambda *shape: TensorType(tuple(shape), "f32")  # noqa: E731
    smoothed_inputs: dict[int, Value] = {}

    def site_input(rw: Rewriter, x: Value, site: Site) -> Value:
        if site.fold != "mul" or site.key not in plan.smooth:
            return x
        if id(x) not in smoothed_inputs:
            inv = rw.builder.op("top.Weight", result_types=[f32(site.k)], name=f"{site.key}.smooth_inv")
            smoothed_inputs[id(x)] = rw.builder.op("top.Mul", x, inv)
        return smoothed_inputs[id(x)]

    def linear(rw: Rewriter, x: Value, w: Value, bias: list[Value], name: str, loc: str | None) -> Value:
        b = rw.builder
        n, k = w.shape
        if plan.modes[name] == "int8":  # w's int8 values are the scheme's QuantizedWeight for it
            return b.op("top.A8MatMul", x, w, *bias, loc=loc, dynamic=dynamic,
                        act_scale=0.0 if dynamic else plan.act_scales[name],
                        out_scale=0.0 if dynamic else plan.out_scales.get(name, 0.0))
        if _smoothed(name, plan, sites):
            w = b.op("top.Weight", result_types=[f32(n, k)], name=f"{name}.smoothed")
        return b.op("top.MatMul", x, w, *bias, right_transpose=True, loc=loc)

    planned = _accepts(frozenset(plan.modes))

    def matmul(op: Operation, rw: Rewriter) -> bool:
        use = next(op_linears(op), None)
        name = use.weight if use is not None and planned(use) else None
        if name is None or name not in site_of:
            return False
        if plan.modes[name] == "bf16" and not _smoothed(name, plan, sites):
            return False
        x, w, *bias = op.operands
        rw.replace(op, [linear(rw, site_input(rw, x, site_of[name]), w, bias, name, op.loc)])
        return True

    def mlp(op: Operation, rw: Rewriter) -> bool:
        found = [weight_name(v) for v in op.operands[1:4]]
        names = [n for n in found if n is not None and n in site_of]
        if len(names) != 3:
            return False
        if all(plan.modes[n] == "bf16" and not _smoothed(n, plan, sites) for n in names):
            return False  # nothing changes: keep the fused op
        gate_n, up_n, down_n = names
        x, wg, wu, wd = op.operands
        b, act = rw.builder, str(op.attrs.get("act", "silu"))
        xs = site_input(rw, x, site_of[gate_n])
        gate = linear(rw, xs, wg, [], gate_n, f"{op.loc}.gate")
        up = linear(rw, xs, wu, [], up_n, f"{op.loc}.up")
        a = b.op("top.SiLU", gate) if act == "silu" else \
            b.op("top.GELU", gate, approximate="tanh" if act == "gelu_tanh" else "none")
        h = b.op("top.Mul", a, up)  # a down-site factor is folded into up's rows: no Mul needed here
        rw.replace(op, [linear(rw, h, wd, [], down_n, f"{op.loc}.down")])
        return True

    apply_patterns(module, {"top.MatMul": [matmul], "top.MLP": [mlp]})
    module.attrs["topq.int8"] = {
        "dynamic_tokens": dynamic,
        "int8_linears": sum(m == "int8" for m in plan.modes.values()),
        "bf16_linears": sorted(n for n, m in plan.modes.items() if m == "bf16"),
        "act_scales": {n: plan.act_scales[n] for n in plan.modes},
        **{k: v for k, v in plan.info.items() if k in ("observer", "percentile", "smooth_alpha") and v is not None},
    }
    search = plan.info.get("mixed_precision")
    if search:  # the search's outcome, without its per-linear sensitivities (those are in the table file)
        module.attrs["topq.int8"]["mixed_precision"] = {k: v for k, v in search.items() if k != "sensitivity"}


# ============================================================================ mixed precision


class _MixedInterpreter(Interpreter):
    """Runs an all-int8 program with a chosen set of linears switched back to their (smoothed) bf16 weights; the
    int8 ones compute exactly as a host bundle does (`top.MatMulInt8` on their codes and scales)."""

    def __init__(self, module: Module, weights: Callable[[str], np.ndarray], forms: _SearchForms) -> None:
        super().__init__(module, weights)
        self.bf16: set[str] = set()
        self._forms = forms  # shared by the search's interpreters

    def run_op(self, step: Step, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if step.op.name == "top.A8MatMul":
            name = str(weight_name(step.op.operands[1]))
            if name in self.bf16:  # stored in bf16 (half the memory of float32), widened exactly per product
                w = self._forms.bf16(name).astype(np.float32)
                return REFERENCE_OPS["top.MatMul"]([inputs[0], w, *inputs[2:]], {"right_transpose": True})
            codes, scale = self._forms.codes[name]
            return REFERENCE_OPS["top.MatMulInt8"]([inputs[0], codes, scale, *inputs[2:]], step.attrs)
        return step.kernel(inputs, step.attrs)


class _SearchForms:
    """The two forms of every linear the search switches between, out of its resident memory: the int8 codes (the
    values, moved to the spill a layer to a map by `calibrate`) and the smoothed weight in bf16 (codes * scale is not
    the float weight), built from the checkpoint a layer at a time when first needed and moved to the spill too.
    A thread that has run a layer releases that layer's pages (`release`), so the search holds about one layer
    per thread instead of the model's every linear twice (`topq.quant.spill`)."""

    def __init__(self, values: Mapping[str, QuantizedWeight], build: Callable[[str], np.ndarray],
                 layer_of: Mapping[str, int], spill: Spill) -> None:
        self.codes = _codes_of(values)
        self._build, self._layer_of, self._spill = build, layer_of, spill
        self._names: dict[int, list[str]] = {}
        for name in values:
            self._names.setdefault(layer_of[name], []).append(name)
        self._bf16: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # one thread builds a layer's bf16 forms, the others wait for them

    def bf16(self, name: str) -> np.ndarray:
        w = self._bf16.get(name)
        if w is None:
            with self._lock:
                if name not in self._bf16:
                    names = self._names[self._layer_of[name]]
                    self._bf16.update(zip(names, self._spill.move([self._build(n) for n in names])))
            w = self._bf16[name]
        return w

    def release(self, layer: int) -> None:
        names = self._names.get(layer, [])
        release([self.codes[n][0] for n in names] + [self._bf16[n] for n in names if n in self._bf16])


def _one_copy(load: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """`load` keeping what it loaded: the interpreters of several threads share one copy of each weight."""
    loaded: dict[str, np.ndarray] = {}

    def shared(name: str) -> np.ndarray:
        array = loaded.get(name)
        if array is None:
            array = loaded[name] = load(name)
        return array

    return shared


def _codes_of(values: Mapping[str, QuantizedWeight]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What `top.MatMulInt8` takes per linear: its int8 codes (the values' own; `int8_matmul` converts a chunk at
    a time, so the search holds no float32 copy of every code) and its scales [N]."""
    return {n: (q.codes, q.scales[:, 0]) for n, q in values.items()}


# The mixed-precision search's held-out windows: a quarter of the calibration windows, at most HELD_OUT_TOKENS
# tokens (at least one window). It compares two models on the same tokens, so a few thousand tokens decide a 5 %
# budget; every full evaluation of the search runs on all of them.
HELD_OUT_TOKENS = 4096
SENSITIVITY_TOKENS = 512  # of those, the tokens (whole windows) the per-linear sensitivity pass runs on
KEEP_EVERY = 4  # a search evaluation keeps each window's hidden state in front of every 4th layer (for the next)


@dataclass
class _Evaluation:
    """One full evaluation of the search: its bf16 set, held-out perplexity, and per held-out window the hidden
    states it kept (layer → state), from which a later evaluation agreeing on the layers before resumes."""

    bf16: set[str]
    ppl: float
    kept: list[dict[int, np.ndarray]]

    def trim(self, last: int) -> None:
        """Drop the states no later evaluation can resume from: those in front of layers after `last`, and the
        dense ones between every KEEP_EVERY-th layer (the sensitivity pass's)."""
        self.kept = [{c: h for c, h in states.items() if c <= last and c % KEEP_EVERY == 0} for states in self.kept]


def mixed_precision(model: Any, cm: _CalibModel, plan: Int8Plan, held_out: np.ndarray, budget: float,
                    dynamic: bool, values: Mapping[str, QuantizedWeight],
                    floats: Mapping[str, np.ndarray], spill: Spill, jobs: int = 1) -> dict[str, Any]:
    """Keep the most damaging linears in bf16 until held-out perplexity ≤ budget × the all-bf16 model's.

    1. sensitivity: each linear alone in int8 (everything else bf16), perplexity on the first held-out windows
       (`SENSITIVITY_TOKENS` tokens, at least one window); the bf16 hidden states in front of every layer are
       computed once, so linear n of layer L only re-runs layers L… (half the model on average);
    2. the cut: linears sorted by damage, the smallest prefix kept in bf16 that meets the budget on all held-out
       windows, found by bisection (perplexity falls as more linears stay bf16) — ~log2(N) full evaluations
       instead of N. An evaluation starts each window at the latest layer before which it agrees with one end of
       the bracket (kept states, `evaluate`): late in the bisection the few linears that differ are mostly deep.

    Its forwards (one per linear in 1, one per window in 2) run on `jobs` threads, each with an interpreter of its
    own and one BLAS thread (as the layer loop's); results are combined in order, so the outcome does not depend
    on `jobs`. The linears' int8 and bf16 forms live in `spill`, each thread holding the layer it runs
    (`_SearchForms`).
    """
    module = cm.module
    rewrite_program(module, plan, cm.sites, dynamic)
    spec, family = model.spec, model.family

    def host(n: str) -> np.ndarray:  # what a bf16 host bundle computes with (smoothing's float rewrites first)
        return round_to_dtype(floats[n] if n in floats else model.weight(n), SCALE_DTYPE)

    rope = rope_weights(spec, cm.seq_len)
    eff = lambda n: _effective(model.checkpoint.weights.get, n, plan.smooth, cm.sites)  # noqa: E731
    layer_of = _layers_of(module, spec.num_layers)
    forms = _SearchForms(values, lambda n: np.asarray(eff(n), np.float32).astype(ELEMENT_TYPES[SCALE_DTYPE]),
                         layer_of, spill)

    def weights(n: str) -> np.ndarray:
        if n in rope:
            return rope[n]
        if n in forms.codes:  # a top.A8MatMul's weight operand: `_MixedInterpreter` reads one of its forms instead
            return np.broadcast_to(np.float32(0), tuple(model.checkpoint.weights.shape(n)))
        return host(n)

    shared = _one_copy(weights)
    local = threading.local()

    def mixed(bf16: set[str]) -> _MixedInterpreter:  # this thread's interpreter, running `bf16` in bf16
        if not hasattr(local, "interp"):
            local.interp = _MixedInterpreter(module, shared, forms)
        local.interp.bf16 = bf16
        return local.interp

    head = shared(family.global_weights["embed" if spec.tie_word_embeddings else "lm_head"])  # tied: one copy
    norm = shared(family.global_weights["final_norm"])
    positions = np.arange(cm.seq_len, dtype=np.int32)[None]
    names = list(plan.modes)

    def embed(w: np.ndarray) -> np.ndarray:
        return mixed(set(names)).run("embedding", [w[None].astype(np.int32)])[0]

    def nll(bf16: set[str], h: np.ndarray, w: np.ndarray, first_layer: int = 0,
            keep: dict[int, np.ndarray] | None = None, every: int = KEEP_EVERY, last: int = spec.num_layers) -> float:
        interp = mixed(bf16)
        for i in range(first_layer, spec.num_layers):
            if keep is not None and i % every == 0 and i <= last:
                keep[i] = h
            h = interp.run(f"block_{i}", [h, positions])[0]
            forms.release(i)
        h = REFERENCE_OPS["top.RMSNorm"]([h, norm], {"eps": spec.rms_norm_eps})[0]
        return head_nll(h[0, :-1], head, w[1:])  # a few positions' logits at a time

    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="topq-int8")

    def each(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:  # in item order
        return list(pool.map(fn, items))

    reused = 0  # layer runs (per window) the search's evaluations took from earlier ones

    def evaluate(bf16: set[str], earlier: Sequence[_Evaluation] = (), dense: int = 0,
                 last: int = spec.num_layers) -> _Evaluation:
        """Held-out perplexity with `bf16` in bf16. Each window resumes from the latest hidden state an `earlier`
        evaluation kept in front of a layer before which both agree on every linear: the same inputs into the
        same kernels, so the same bits as a run from the embedding. States are kept in front of layers up to
        `last` only (later evaluations resume no later); the first `dense` windows keep the state in front of
        every layer (the sensitivity pass's prefixes)."""
        nonlocal reused
        start, base = 0, None
        for other in earlier:  # every evaluation keeps the states in front of layers 0, KEEP_EVERY, 2·KEEP_EVERY…
            first = min((layer_of[n] for n in bf16 ^ other.bf16), default=spec.num_layers - 1)
            at = min(first, spec.num_layers - 1) // KEEP_EVERY * KEEP_EVERY
            if at > start:
                start, base = at, other

        def window(i: int) -> tuple[float, dict[int, np.ndarray]]:
            w, every = held_out[i], 1 if i < dense else KEEP_EVERY
            if base is None:
                keep: dict[int, np.ndarray] = {}
                return nll(bf16, embed(w), w, 0, keep, every, last), keep
            keep = {c: h for c, h in base.kept[i].items() if c < start and c % KEEP_EVERY == 0}  # the shared prefix
            return nll(bf16, base.kept[i][start], w, start, keep, every, last), keep

        results = each(window, range(len(held_out)))
        reused += start * len(held_out)
        total = sum(r[0] for r in results)
        return _Evaluation(bf16, math.exp(total / (len(held_out) * (held_out.shape[1] - 1))),
                           [r[1] for r in results])

    with blas_threads(fixed_threads() or 1):  # parallel are the threads (`jobs`), as in the layer loop
        try:
            probe = held_out[:max(1, SENSITIVITY_TOKENS // held_out.shape[1])]
            # the search's bracket, its ends' evaluations; the all-bf16 one also keeps the probe windows' prefixes
            kept = {len(names): evaluate(set(names), dense=len(probe)), 0: evaluate(set())}
            reference, current = kept[len(names)].ppl, kept[0].ppl
            limit = budget * reference
            report: dict[str, Any] = {"bf16_ppl": reference, "int8_ppl": current, "budget": budget}
            chosen: list[str] = []
            if current > limit:
                # per probe window: the bf16 model's hidden state in front of every layer
                prefixes = [[kept[len(names)].kept[i][layer] for layer in range(spec.num_layers)]
                            for i in range(len(probe))]
                tokens = len(probe) * (probe.shape[1] - 1)

                bar = progress_bar(total=len(names), desc="int8 sensitivity", unit="linear")

                def sensitivity(n: str) -> float:
                    layer = layer_of[n]
                    total = sum(nll(set(names) - {n}, states[layer], w, layer) for states, w in zip(prefixes, probe))
                    bar.update()
                    return total / tokens

                damage = dict(zip(names, each(sensitivity, names)))
                bar.close()
                del prefixes  # the probe windows' dense states: `trim` below frees them
                order = sorted(names, key=lambda n: -damage[n])
                lo, hi = 0, len(order)  # invariant: keeping order[:hi] in bf16 meets the budget (all bf16 does)
                # Every later evaluation keeps order[:m] in bf16 for some lo < m < hi, so it resumes from the lower
                # end no later than order[lo]'s layer and from the upper end no later than order[hi - 1]'s: the
                # ends keep no state in front of a later layer (memory only; the same evaluations).
                def lower_last(end: int) -> int:  # the latest layer a resume from lower end `end` can start at
                    return layer_of[order[end]]

                def upper_last(end: int) -> int:
                    return layer_of[order[end - 1]]

                kept[lo].trim(lower_last(lo))
                kept[hi].trim(upper_last(hi))
                results = {hi: reference, 0: current}
                bar = progress_bar(total=max(1, math.ceil(math.log2(len(order) + 1))), desc="int8 mixed precision",
                                   unit="eval")
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    kept[mid] = evaluate(set(order[:mid]), [kept[lo], kept[hi]],
                                         last=max(lower_last(mid), upper_last(mid)))
                    results[mid] = kept[mid].ppl
                    bar.set_postfix_str(f"{mid} bf16: ppl {results[mid]:.3f} / {limit:.3f}")
                    bar.update()
                    lo, hi = (lo, mid) if results[mid] <= limit else (mid, hi)
                    kept[mid].trim(upper_last(mid) if hi == mid else lower_last(mid))
                    kept = {lo: kept[lo], hi: kept[hi]}
                bar.close()
                chosen, current = order[:hi], results[hi]
                report["cut_evaluations"] = len(results) - 2
                report["cut_ppl"] = [[k, results[k]] for k in sorted(results)]  # [bf16 linears, held-out perplexity]
                report["cut_layers_reused"] = reused
                report["sensitivity"] = {n: round(damage[n], 6) for n in order}  # mean NLL with only n in int8
            for n in chosen:
                plan.modes[n] = "bf16"
            int8_params = sum(int(np.prod(model.checkpoint.weights.shape(n))) for n in names if plan.modes[n] == "int8")
            all_params = sum(int(np.prod(model.checkpoint.weights.shape(n))) for n in names)
            report.update(final_ppl=current, bf16_linears=len(chosen),
                          int8_weight_fraction=round(int8_params / all_params, 4) if all_params else 0.0)
            return report
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _layers_of(module: Module, num_layers: int) -> dict[str, int]:
    """The decoder layer (block function) each weight is read in."""
    return {str(op.attrs["name"]): i for i in range(num_layers) for op in module[f"block_{i}"].ops
            if op.name == "top.Weight"}


# ============================================================================ the error report

REPORT_WINDOWS = 4  # calibration windows the per-linear error report runs on


class _ErrorInterpreter(Interpreter):
    """The float model whose tap measures, at every planned linear, what its int8 (or bf16) form makes of the
    same input."""

    def __init__(self, module: Module, weights: Callable[[str], np.ndarray], at_op: dict[int, list[Site]],
                 quantized: Callable[[str, np.ndarray], np.ndarray]) -> None:
        super().__init__(module, weights, tap=self._measure)
        self.at_op, self.quantized = at_op, quantized
        self.sums: dict[str, list[float]] = {}  # name → [||Y - Ŷ||², ||Y||²]

    def _measure(self, step: Step, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for site in self.at_op.get(id(step.op), ()):
            if site.kind == MLP_HIDDEN:
                x = mlp_hidden(inputs[0], inputs[1], inputs[2], str(step.attrs.get("act", "silu")))[2]
            else:
                x = inputs[0].reshape(-1, inputs[0].shape[-1])
            for name in site.names:  # a site is seen once, at its first linear: the others read the same input
                # float32 products: an error of 1e-3 or more is measured to 1e-7 of itself; the sums are float64
                y = (x @ np.asarray(self.weights(name), np.float32).T).astype(np.float64)
                d = y - self.quantized(name, x)
                sums = self.sums.setdefault(name, [0.0, 0.0])
                sums[0] += float(np.sum(d * d))
                sums[1] += float(np.sum(y * y))


def error_report(model: Any, plan: Int8Plan, linears: frozenset[str], windows: np.ndarray,
                 dynamic: bool, values: Mapping[str, QuantizedWeight], jobs: int = 1) -> list[dict[str, Any]]:
    """Per linear, the relative Frobenius error ||XWᵀ − f(X)||/||XWᵀ|| of its planned form f (int8 with the plan's
    scales and smoothing, or bf16) against the float linear, X = the float model's inputs on the first
    `REPORT_WINDOWS` calibration windows.

    It runs layer by layer — every window through one block, then the next — so one layer's float weights (and
    its linears' bf16 forms) are loaded at a time, not the whole float model. A layer's windows run on `jobs`
    threads (one BLAS thread each, an interpreter per thread); each linear's sums are added in window order, so
    the report does not depend on `jobs`."""
    windows = windows[:REPORT_WINDOWS]
    cm = _calib_model(model, windows.shape[1], linears)
    store = model.checkpoint.weights
    site_of = {n: site for site in cm.sites for n in site.names}
    forms: dict[str, tuple[np.ndarray, ...]] = {}  # this layer's linears: bf16 weight, or (codes, scales)

    def quantized(name: str, x: np.ndarray) -> np.ndarray:
        s = plan.smooth.get(site_of[name].key)
        x_s = x if s is None else x / s
        if name not in forms:
            if plan.modes[name] == "bf16":
                w_eff = _effective(store.get, name, plan.smooth, cm.sites)
                forms[name] = (round_to_dtype(w_eff, SCALE_DTYPE),)
            else:
                forms[name] = (values[name].codes, values[name].scales[:, 0])  # int8: `int8_matmul` converts
        if plan.modes[name] == "bf16":
            return (x_s @ forms[name][0].T).astype(np.float64)
        q, scale = forms[name]
        attrs = {"act_scale": 0.0 if dynamic else plan.act_scales[name], "dynamic": dynamic}
        if not dynamic and plan.out_scales.get(name):
            attrs["out_scale"] = plan.out_scales[name]
        return REFERENCE_OPS["top.MatMulInt8"]([x_s, q, scale], attrs)[0].astype(np.float64)

    positions = np.arange(cm.seq_len, dtype=np.int32)[None]
    totals: dict[str, list[float]] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="topq-int8-report")
    bar = progress_bar(total=model.spec.num_layers, desc="int8 error report", unit="layer")
    with blas_threads(fixed_threads() or 1), pool:
        embedding = Interpreter(cm.module, cm.weights)
        hidden = [embedding.run("embedding", [w[None].astype(np.int32)])[0] for w in windows]
        del embedding
        for i in range(model.spec.num_layers):
            # this layer's interpreters and their one copy of its weights: dropped with them after the layer
            local, shared = threading.local(), _one_copy(cm.weights)

            def run(h: np.ndarray, name: str = f"block_{i}", local: Any = local,
                    shared: Callable[[str], np.ndarray] = shared) -> tuple[np.ndarray, dict[str, list[float]]]:
                if not hasattr(local, "interp"):
                    local.interp = _ErrorInterpreter(cm.module, shared, cm.at_op, quantized)
                local.interp.sums = {}
                return local.interp.run(name, [h, positions])[0], local.interp.sums

            results = list(pool.map(run, hidden))
            for sums in (s for _, s in results):  # window order
                for name, (e, r) in sums.items():
                    total = totals.setdefault(name, [0.0, 0.0])
                    total[0] += e
                    total[1] += r
            hidden = [h for h, _ in results]
            del results, run, local, shared
            release(array for form in forms.values() for array in form)  # the spilled codes (`calibrate`)
            forms.clear()
            bar.update()
    bar.close()
    return [{"name": n, "mode": plan.modes[n], "error": math.sqrt(e / r) if r > 0 else 0.0}
            for n, (e, r) in sorted(totals.items(), key=lambda kv: _natural(kv[0]))]


def _natural(name: str) -> list[Any]:
    """Sort key: layer 2 before layer 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ============================================================================ the scheme


def _linear_names(model: Any) -> frozenset[str]:
    """Decoder-layer linears (the lm_head follows quant.lm_head, as for every scheme)."""
    from topq.ir.analysis import linear_weight_names

    head = model.family.global_weights["embed" if model.spec.tie_word_embeddings else "lm_head"]
    return frozenset(n for n in linear_weight_names(model.module) if n != head)


def calibrate(model: Any, recipe: Any, *, executor: Any = None) -> dict[str, Any]:
    from topq.quant.calibration import CalibrationResult, calibration_windows

    if any(use.linear.expert is not None for f in model.module for op in f.walk() for use in op_linears(op)):
        raise TopqError("quant scheme int8 does not support mixture-of-experts models (routed expert linears); "
                        "use rtn, gptq, awq or autoround")
    opts = Int8Options.from_recipe(recipe)
    keep_freed_memory()  # the observer pass, the search and the report allocate the same large temporaries again
    jobs = int(executor.jobs) if executor is not None and executor.name == "local" else 1  # threads of this process
    linears = _linear_names(model)
    store = model.checkpoint.weights
    table = Path(opts.table) if opts.table else None
    windows: np.ndarray | None = None  # none when the table is reused: no calibration data is read
    values: dict[str, QuantizedWeight] | None = None  # the int8 linears' values (the search computes them first)
    if table is not None and table.exists():
        plan = Int8Plan.from_yaml(table.read_text(), str(table))
        seq_len = int(plan.info.get("seq_len", 16))
        cm = _calib_model(model, seq_len, linears)
        missing = sorted(linears - set(plan.modes))
        if missing:
            raise TopqError(f"{table}: no entry for linear {missing[0]} (the table is for another model?)")
        unscaled = [n for n, m in plan.modes.items() if m == "int8" and plan.act_scales[n] <= 0]
        if unscaled and not opts.dynamic:
            raise TopqError(f"{table}: {unscaled[0]} has no static activation scale (the table was made with "
                            f"dynamic_tokens: true); delete it to calibrate again")
    else:
        windows = calibration_windows(model, recipe)
        held_out = windows[:0]
        if opts.budget is not None:
            if len(windows) < 2:
                raise TopqError("quant.budget needs at least 2 calibration samples (some are held out for perplexity)")
            cut = len(windows) - max(1, min(len(windows) // 4, HELD_OUT_TOKENS // windows.shape[1]))
            windows, held_out = windows[:cut], windows[cut:]
        plan, cm = calibrate_plan(model, windows, linears, opts, executor)
        if opts.budget is not None:  # every planned linear is int8 until the search sends some back to bf16
            spill = Spill(spill_directory(recipe.output.path))
            layer_of = _layers_of(cm.module, model.spec.num_layers)
            planned, values = int8_values(store.get, plan, cm.sites), {}
            try:
                for layer in sorted({layer_of[n] for n in planned}):  # a map a layer: the search releases it whole
                    values.update(move_quantized(spill, {n: planned.pop(n) for n in list(planned)
                                                         if layer_of[n] == layer}))
                plan.info["mixed_precision"] = mixed_precision(model, cm, plan, held_out, opts.budget, opts.dynamic,
                                                               values, float_rewrites(store.get, plan, cm.sites),
                                                               spill, jobs)
            finally:
                spill.close()
        if table is not None:
            with atomic_file(table) as fh:
                fh.write(plan.to_yaml().encode())
    if values is None:
        values = int8_values(store.get, plan, cm.sites)
    result = CalibrationResult({n: v for n, v in values.items() if plan.modes[n] == "int8"})
    result.float_weights = float_rewrites(store.get, plan, cm.sites)
    result.state["int8_table"] = plan.to_yaml()  # what `restore` rewrites the program from (workers that load this)
    if windows is not None:
        result.report = error_report(model, plan, linears, windows, opts.dynamic, result, jobs)
    rewrite_program(model.module, plan, cm.sites, opts.dynamic)
    return result


def restore(model: Any, recipe: Any, result: Any) -> None:
    """Redo `calibrate`'s rewrite of the program from its stored result, without calibrating (a worker that does
    not share the converting process's memory; the values and float rewrites come with the stored result)."""
    opts = Int8Options.from_recipe(recipe)
    plan = Int8Plan.from_yaml(result.state["int8_table"], "stored int8 calibration")
    cm = _calib_model(model, int(plan.info.get("seq_len", 16)), _linear_names(model))
    rewrite_program(model.module, plan, cm.sites, opts.dynamic)


SCHEME = QuantScheme(
    name="int8",
    description="W8A8: per-channel int8 weights, int8 activations (static calibrated per tensor, or per token)",
    compute_dtype="bf16",
    weight_bits=8,
    options=OPTIONS,
    needs_calibration=True,
    calibrate=calibrate,
    restore=restore,
    # bf16 everywhere but the int8 linears, whose weights are per-channel 8-bit
    product=lambda options: SchemeProduct("bf16", (8,), int8_activations=True),
)


@topq.hookimpl
def register_quant_schemes(register: Register[QuantScheme]) -> None:
    register(SCHEME)
