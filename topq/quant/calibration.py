"""Calibration for data-driven weight quantization (GPTQ, AWQ, AutoRound): sample data and the layer loop.

Data (`quant.calibration`): `samples` windows of `seq_len` tokens, chosen deterministically from `seed`, out of
one token stream read from `data`:

* a plain text file (any other suffix), tokenized with the checkpoint's tokenizer;
* `.jsonl`: one JSON object per line with a string field `text` (each record tokenized on its own);
* `.ids`: token ids as text, separated by whitespace and/or commas (models without a tokenizer, tests);
* `.npy`: an integer numpy array of token ids (any shape, read flat);
* a directory: every non-hidden file below it in sorted path order, each read by its suffix.

The layer loop (`run_calibration`) keeps only one layer's activations: it embeds every window, then for each
decoder layer and each of its quant groups (linears sharing an input, `ModelFamily.quant_groups`) it runs the
layer on all windows — stopping as soon as that group's input has been seen, and taking from the layer's earlier
runs every value that no weight solved since changed (`topq.quant.reuse`) — and accumulates what the solvers
need (`InputStats`: H = mean xᵀx and mean |x| per channel; every algorithm here measures the layer-output error
||X Wᵀ - X Ŵᵀ||² through H, exactly and over all tokens). Groups are solved in order ("true sequential"), so a
group's inputs already come through the quantized groups before it; finally the whole layer runs once more with
its quantized weights and that output feeds the next layer, so every layer is calibrated on what the quantized
model will really see. The per-sample runs are tasks on the conversion's executor (this process, threads of it for
a local pool, or Ray; docs/conversion.md); the statistics are summed here in sample order, so results do not depend
on it.

Solvers live in the scheme plugins; they read weights and publish results through `LayerState`.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from topq.core.calibration_result import CalibrationResult, load_calibration, save_calibration
from topq.core.errors import TopqError
from topq.core.executors import InlineExecutor, TaskExecutor, resolve
from topq.core.progress import progress_bar
from topq.core.quant import Option, QuantizedWeight, QuantScheme, SchemeProduct
from topq.core.stages import rope_weights
from topq.ir.analysis import linear_uses, producer, weight_name
from topq.ir.graph import Function, Module, Operation, Value
from topq.ir.interpreter import Interpreter, Step
from topq.ir.products import GRAM_STRIP, bf16_operand, check_kind, gram_upper, products, torch_threads
from topq.ir.reference_ops import REFERENCE_OPS, mlp_down, mlp_hidden, moe_expert_tokens, moe_routing
from topq.ir.threads import blas_threads, fixed_threads
from topq.ir.types import round_to_dtype
from topq.quant.grid import (
    MapFn,
    check_bits,
    output_error,
    output_errors,
    quantize_groups,
    resolve_group_size,
    serial_map,
)
from topq.quant.memory import keep_freed_memory
from topq.quant.options import (
    ACT_DTYPE,
    CALIBRATION_MATMUL,
    EXPERT_MIN_TOKENS,
    EXPERT_MIN_TOKENS_OPTION,
    WEIGHT_OPTIONS,
    act_dtype,
)
from topq.quant.program import ProgramSource, calibration_program, program_source
from topq.quant.reuse import Cache, LayerValues, inner_key
from topq.quant.sites import INPUT, FoldTarget, group_sites
from topq.quant.spill import Spill, mapping_of, move_quantized, spill_directory

if TYPE_CHECKING:
    from topq.core.pipeline import LoadedModel
    from topq.core.recipe import Recipe

__all__ = [
    "CalibrationResult", "FoldTarget", "GroupInputs", "HessianStats", "InputStats", "LayerInputs", "LayerState",
    "LayerTuner",
    "calibration_scheme", "calibration_windows", "load_calibration", "quantization_report", "read_token_stream",
    "run_calibration", "sample_windows", "save_calibration", "stacked_solver", "weight_options",
]

# ================================================================================ calibration data

_ID_SEPARATORS = re.compile(r"[\s,]+")


def read_token_stream(path: str | Path, tokenizer_files: Mapping[str, str] | None = None,
                      vocab_size: int | None = None, progress: bool = True) -> np.ndarray:
    """All tokens of `path` (file or directory) as one int64 stream; see the module doc for the formats."""
    root = Path(path)
    if not root.exists():
        raise TopqError(f"calibration data not found: {root}")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not files:
            raise TopqError(f"calibration data directory {root} has no files")
    else:
        files = [root]
    tokenizer = None
    streams: list[np.ndarray] = []
    for file in progress_bar(files, desc="calibration data", unit="file", disable=not progress or len(files) < 2):
        suffix = file.suffix.lower()
        if suffix == ".npy":
            streams.append(_read_npy(file))
        elif suffix == ".ids":
            streams.append(_read_ids(file))
        else:
            texts = _read_jsonl(file) if suffix == ".jsonl" else [_read_text(file)]
            if tokenizer is None:
                tokenizer = _tokenizer(tokenizer_files, file)
            streams.extend(_tokenize(tokenizer, texts, file, progress))
    tokens = np.concatenate(streams) if streams else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise TopqError(f"calibration data {root} has no tokens")
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.max()) if tokens.max() >= vocab_size else int(tokens.min())
        raise TopqError(f"calibration data {root}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return tokens


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TopqError(f"calibration data {file} is not UTF-8 text (token ids go in .ids or .npy files)") from None


def _read_jsonl(file: Path) -> list[str]:
    texts = []
    for number, line in enumerate(_read_text(file).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TopqError(f"calibration data {file}:{number}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise TopqError(f"calibration data {file}:{number}: expected an object with a string field 'text'")
        texts.append(record["text"])
    return texts


def _read_ids(file: Path) -> np.ndarray:
    words = [w for w in _ID_SEPARATORS.split(_read_text(file)) if w]
    try:
        return np.array([int(w) for w in words], dtype=np.int64)
    except ValueError:
        bad = next(w for w in words if not w.lstrip("+-").isdigit())
        raise TopqError(f"calibration data {file}: {bad[:20]!r} is not a token id (.ids files hold integers)") from None


def _read_npy(file: Path) -> np.ndarray:
    try:
        array = np.load(file, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise TopqError(f"calibration data {file}: not a numpy array file ({exc})") from None
    if not np.issubdtype(array.dtype, np.integer):
        raise TopqError(f"calibration data {file}: token ids must be integers, got {array.dtype}")
    return array.reshape(-1).astype(np.int64)


def _tokenizer(files: Mapping[str, str] | None, source: Path) -> Any:
    from topq.io.tokenizer import load_tokenizer

    if not files:
        raise TopqError(f"calibration data {source} is text but the checkpoint has no tokenizer; "
                        "give token ids in a .ids or .npy file")
    return load_tokenizer(files)


_TEXT_CHUNK = 1 << 16  # characters per tokenizer call: keeps the progress bar moving on one big book


def _split_text(text: str, size: int = _TEXT_CHUNK) -> list[str]:
    """Pieces of at most `size` characters, cut after a paragraph break (else before a space, where BPE tokenizers
    start a new word anyway), so cutting changes the tokens as little as possible."""
    pieces, start = [], 0
    while len(text) - start > size:
        window = text[start:start + size]
        paragraph = window.rfind("\n\n")
        cut = paragraph + 2 if paragraph > 0 else window.rfind(" ")
        cut = cut if cut > 0 else size
        pieces.append(window[:cut])
        start += cut
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _tokenize(tokenizer: Any, texts: Sequence[str], source: Path, progress: bool) -> list[np.ndarray]:
    chunks = [piece for text in texts for piece in _split_text(text)]
    out = []
    for chunk in progress_bar(chunks, desc=f"tokenize {source.name}", unit="chunk",
                              disable=not progress or len(chunks) < 4):
        ids = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def sample_windows(tokens: np.ndarray, samples: int, seq_len: int, seed: int, source: str = "data") -> np.ndarray:
    """`samples` non-overlapping windows [samples, seq_len] (int32) at random positions drawn from `seed`.

    Windows never overlap, so every sample is distinct text; the free tokens between them are spread at random
    (sorted gaps), which keeps the choice uniform over all non-overlapping placements."""
    needed = samples * seq_len
    if len(tokens) < needed:
        raise TopqError(f"calibration data {source}: needs {needed} tokens ({samples} samples × {seq_len}), "
                        f"has {len(tokens)}; lower quant.calibration.samples or seq_len")
    rng = np.random.default_rng(seed)
    gaps = np.sort(rng.integers(0, len(tokens) - needed + 1, size=samples))
    starts = gaps + np.arange(samples) * seq_len
    return np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int32)


def calibration_windows(model: LoadedModel, recipe: Recipe, progress: bool = True) -> np.ndarray:
    """The recipe's calibration samples for this model: int32 [samples, seq_len]."""
    cal = recipe.quant.calibration
    if cal.data is None:
        raise TopqError(f"quant scheme {recipe.quant.scheme} needs calibration data: set quant.calibration.data")
    tokens = read_token_stream(cal.data, model.checkpoint.tokenizer_files, model.spec.vocab_size, progress)
    return sample_windows(tokens, int(cal.samples), int(cal.seq_len), int(cal.seed), str(cal.data))


# ================================================================================ statistics


Summary = tuple[list[np.ndarray], np.ndarray | None, int]


class InputStats:
    """Running statistics of one linear input x [tokens, K]: Gram matrix Σxᵀx (float64, its upper triangle) and
    Σ|x|."""

    def __init__(self, k: int) -> None:
        self.k = k
        # Σxᵀx on and above the diagonal; below it only what the strips' diagonal blocks add, which `hessian` drops
        self._upper = np.zeros((k, k), dtype=np.float64)
        self.abs_sum: np.ndarray | None = np.zeros(k, dtype=np.float64)
        self.count = 0

    def add(self, x: np.ndarray) -> None:
        self.add_summary(self.summarize(x))

    @staticmethod
    def summarize(x: np.ndarray) -> Summary:
        """One sample's share: its float32 Gram xᵀx as `gram_upper`'s strips (the costly part; the layer loop's
        tasks compute it in parallel, with the step's products: `topq.ir.products`), Σ|x| and its token count."""
        x2 = _rows(x)
        return gram_upper(x2), np.abs(x2).sum(axis=0, dtype=np.float64), x2.shape[0]

    def add_summary(self, summary: Summary) -> None:
        strips, abs_sum, count = summary
        # float32 products per sample (fast), accumulated across samples in float64 (no drift over many samples);
        # only the upper triangle, half the adds: `hessian` mirrors it
        for start, strip in zip(range(0, self.k, GRAM_STRIP), strips):
            self._upper[start:start + GRAM_STRIP, start:] += strip
        if self.abs_sum is not None:  # HessianStats keeps none
            self.abs_sum += abs_sum
        self.count += count

    def hessian(self) -> np.ndarray:
        """H = mean xᵀx [K, K]: ||X Wᵀ - X Ŵᵀ||² / tokens = Σ_n ΔW_n H ΔW_nᵀ."""
        if self.count == 0:
            raise TopqError("calibration captured no inputs for a quant group")
        gram = np.triu(self._upper)
        for start in range(0, self.k, GRAM_STRIP):  # mirrored strip by strip (no [K, K] temporaries): copies
            stop = start + GRAM_STRIP
            gram[stop:, start:stop] = gram[start:stop, stop:].T
            diagonal = gram[start:stop, start:stop]
            below = np.tril_indices(len(diagonal), -1)
            diagonal[below] = diagonal.T[below]
        gram /= self.count
        return gram

    def abs_mean(self) -> np.ndarray:
        """Mean |x| per input channel (AWQ's activation salience)."""
        if self.abs_sum is None:
            raise TopqError(f"{type(self).__name__} does not collect mean |x|: observe with InputStats")
        return self.abs_sum / max(self.count, 1)


class HessianStats(InputStats):
    """InputStats without Σ|x|, for the schemes that read only H (GPTQ, AutoRound): a pass over every captured
    input less per sample. H is the same bits as InputStats'."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.abs_sum = None

    @staticmethod
    def summarize(x: np.ndarray) -> Summary:
        x2 = _rows(x)
        return gram_upper(x2), None, x2.shape[0]


def _rows(x: np.ndarray) -> np.ndarray:
    """x as float32 [tokens, K]."""
    x2 = np.asarray(x, dtype=np.float32)
    return x2.reshape(-1, x2.shape[-1])


# ================================================================================ layer state


class LayerState:
    """The model's weights as calibration changes them: quantized linears, rewritten float tensors.

    Solvers read float weights with `float_weight`, publish with `set_quantized`/`set_quantized_rows`/`set_float`,
    and fold a group's input scale into an earlier op with `fold_input_scale` (`scale_rows` for one tensor).
    `version` changes on every write so the interpreter knows to reload its weights."""

    def __init__(self, model_weight: Callable[[str], np.ndarray], extra: Mapping[str, np.ndarray] | None = None,
                 scale_dtype: str = "f32", spill: Spill | None = None) -> None:
        self._model_weight = model_weight
        self._extra = dict(extra or {})
        self.scale_dtype = scale_dtype
        self.result = CalibrationResult()
        self._spill = spill
        self._float_cache: dict[str, np.ndarray] = {}
        self._dequant_cache: dict[str, np.ndarray] = {}
        self.version = 0
        self._written: dict[str, int] = {}  # name → `version` of its last write
        self._input_scales: dict[str, np.ndarray] = {}  # `fold_input_scale` since `take_input_scales`

    def float_weight(self, name: str) -> np.ndarray:
        """The float value of a tensor (rewritten if an algorithm rewrote it); callers must not modify it."""
        if name in self.result.float_weights:
            return self.result.float_weights[name]
        if name in self._extra:
            return self._extra[name]
        array = self._float_cache.get(name)
        if array is None:
            array = self._float_cache[name] = np.asarray(self._model_weight(name), dtype=np.float32)
        return array

    def current_weight(self, name: str) -> np.ndarray:
        """What the model computes with right now: dequantized for a quantized linear, else the float value."""
        qw = self.result.get(name)
        if qw is None:
            return self.float_weight(name)
        array = self._dequant_cache.get(name)
        if array is None:
            array = self._dequant_cache[name] = qw.dequantize()
        return array

    def has(self, name: str) -> bool:
        if name in self.result or name in self.result.float_weights or name in self._extra:
            return True
        try:
            self._model_weight(name)
        except TopqError:
            return False
        return True

    def set_quantized(self, name: str, qw: QuantizedWeight) -> None:
        """Publish a quantized linear. Its scales are stored as the target stores them (the compute dtype), so the
        rest of the calibration — and the host bundle — computes with exactly the chip's values."""
        if self.scale_dtype != "f32":
            qw = QuantizedWeight(qw.codes, round_to_dtype(qw.scales, self.scale_dtype), qw.zeros, qw.bits,
                                 qw.group_size, qw.symmetric, qw.g_idx)
        self.result[name] = qw
        self._dequant_cache.pop(name, None)
        self.version += 1
        self._written[name] = self.version

    def set_quantized_rows(self, names: Sequence[str], stacked: QuantizedWeight) -> None:
        """Split a QuantizedWeight solved for linears stacked along N back into one per linear."""
        start = 0
        for name in names:
            rows = self.float_weight(name).shape[0]
            part = slice(start, start + rows)
            self.set_quantized(name, QuantizedWeight(
                codes=stacked.codes[part], scales=stacked.scales[part], zeros=stacked.zeros[part],
                bits=stacked.bits, group_size=stacked.group_size, symmetric=stacked.symmetric, g_idx=stacked.g_idx))
            start += rows
        if start != stacked.codes.shape[0]:
            raise TopqError(f"solver returned {stacked.codes.shape[0]} rows for {', '.join(names)} ({start} expected)")

    def set_float(self, name: str, array: np.ndarray) -> None:
        self.result.float_weights[name] = np.asarray(array, dtype=np.float32)
        self.version += 1
        self._written[name] = self.version

    def written_since(self, version: int) -> frozenset[str]:
        """The tensors written after `version` (what a layer run that read the weights then must recompute)."""
        return frozenset(name for name, v in self._written.items() if v > version)

    def scale_rows(self, name: str, factor: np.ndarray) -> None:
        """Multiply output row n of tensor `name` by factor[n] (a 1-D tensor: element n). A quantized linear
        keeps its codes: its per-row scales absorb the factor (exact up to storing the scales in the compute dtype)."""
        factor = np.asarray(factor, dtype=np.float64)
        qw = self.result.get(name)
        if qw is not None:
            scales = (qw.scales.astype(np.float64) * factor[:, None]).astype(np.float32)
            self.set_quantized(name, QuantizedWeight(qw.codes, scales, qw.zeros, qw.bits, qw.group_size,
                                                     qw.symmetric, qw.g_idx))
            return
        array = self.float_weight(name).astype(np.float64)
        shape = (-1,) + (1,) * (array.ndim - 1)
        self.set_float(name, array * factor.reshape(shape))

    def fold_input_scale(self, fold: FoldTarget, s_fold: np.ndarray) -> None:
        """Divide the producer of a group's input x by s (`s_fold` per producer channel, `fold.tie` maps x's
        channels to them), so that the group's linears read x / s. The layer loop then divides the values it kept
        of x by s instead of computing them again (`take_input_scales`)."""
        inv = 1.0 / np.asarray(s_fold, dtype=np.float64)
        if fold.kind == "norm":
            self.set_float(fold.weight, self.float_weight(fold.weight) * inv)
            if fold.bias:
                self.set_float(fold.bias, self.float_weight(fold.bias) * inv)
        elif fold.kind == "rows":
            self.scale_rows(fold.weight, inv)
            if fold.bias and self.has(fold.bias):
                self.scale_rows(fold.bias, inv)
        else:
            raise TopqError(f"unknown fold kind {fold.kind!r}")
        self._input_scales[fold.weight] = s_fold[fold.tie] if fold.tie is not None else s_fold

    def take_input_scales(self) -> dict[str, np.ndarray]:
        """The folds since the last call: fold weight → s per channel of the input it divides (and forget them)."""
        taken, self._input_scales = self._input_scales, {}
        return taken

    def record(self, names: Sequence[str], weights: Sequence[np.ndarray], effective: Sequence[np.ndarray],
               h: np.ndarray, bits: int, group_size: int | None, symmetric: bool, map: MapFn = serial_map) -> None:
        """Log each linear's calibration output error next to plain RTN's (both through the same H), relative to
        ||X Wᵀ||² over the same inputs (relative Frobenius norms of the outputs). The products run on `map`
        (`GroupInputs.map`)."""
        # every row of every linear's three products (its error, RTN's, the reference) through H
        rows = [(w - w_eff, w - quantize_groups(w, bits, group_size, symmetric).dequantize(), w)
                for w, w_eff in zip(weights, effective)]
        sums = output_errors([part for parts in rows for part in parts], h, map)
        for name, (error, rtn_error, reference) in zip(names, sums.reshape(len(rows), 3)):

            def rel(e: float, reference: float = float(reference)) -> float:
                return float(np.sqrt(e / reference)) if reference > 0 else 0.0

            self.result.report.append({"name": name, "rtn_error": rel(rtn_error), "error": rel(error),
                                       "ratio": float(error / rtn_error) if rtn_error > 0 else 0.0})

    def end_layer(self) -> None:
        """Drop cached float copies of the finished layer and move its quantized values to the spill, if there is
        one (memory stays at one layer's weights; `topq.quant.spill`)."""
        self._float_cache.clear()
        self._dequant_cache.clear()
        if self._spill is not None:
            self.result.update(move_quantized(self._spill, {n: qw for n, qw in self.result.items()
                                                            if mapping_of(qw.codes) is None}))


# ================================================================================ the graph side


@dataclass
class GroupInputs:
    """One quant group of one layer as a solver sees it.

    `map(fn, items)` is `[fn(item) for item in items]`, run on the layer loop's jobs when it has threads (the
    solver's independent parts, e.g. AWQ's candidates: the loop's tasks wait for the solver). Each call runs on one
    BLAS thread, whatever thread runs it, so the results are those of the serial loop."""

    layer: int
    keys: tuple[str, ...]
    names: tuple[str, ...]
    stats: Any  # what the scheme's `observe` made (default InputStats)
    fold: FoldTarget | None = None
    tokens: int = 0  # calibration tokens that reached this input (an expert's coverage)
    map: MapFn = serial_map


@dataclass
class LayerInputs:
    """One decoder layer as a layer tuner sees it (`LayerTuner`): the tuner quantizes every linear of the layer at
    once, on the layer's output. `inputs` are what the quantized model feeds the layer (the quantized layers
    before it), read-only (the loop runs the quantized layer on them next); `float_inputs` what the float model
    feeds it, which the tuner may overwrite with the float layer's outputs (what it returns; the loop does not
    read them again). Both [samples, L, H]."""

    layer: int
    module: Module
    name: str  # the layer's program function
    inputs: np.ndarray
    float_inputs: np.ndarray
    linears: tuple[str, ...]  # the layer's quantized linears, group by group
    map: MapFn = serial_map  # as `GroupInputs.map`


@dataclass(frozen=True)
class LayerTuner:
    """A scheme's whole-layer solver (AutoRound's block objective). `covers(function, options)`: it tunes this
    layer (else the layer's groups go to the group solver, as for any scheme). `tune(layer, state, options)`
    publishes the layer's quantized linears through `state` and returns the float model's outputs of the layer
    [samples, L, H] (the next layer's `float_inputs`; may be this layer's `float_inputs` buffer, overwritten)."""

    covers: Callable[[Function, Mapping[str, Any]], bool]
    tune: Callable[[LayerInputs, LayerState, Mapping[str, Any]], np.ndarray]


@dataclass
class _GroupPlan:
    keys: tuple[str, ...]
    names: tuple[str, ...]
    op: Operation  # the op whose input is captured
    kind: str  # "input": operand `operand`; "mlp_hidden": act(x Wgᵀ) * (x Wuᵀ) inside the op (from `hidden_from`)
    k: int
    fold: FoldTarget | None = None
    operand: int = 0
    expert: int | None = None  # only the tokens `op` routes to this expert reach the group (top.MoE)
    hidden_from: tuple[int, int, int] = (0, 1, 2)


def _find_groups(function: Function, family: Any, spec: Any, layer: int) -> list[_GroupPlan]:
    """The quant groups of one block function, in execution order, with what to capture and where to fold.

    The family's groups (a group none of whose linears the layer has is skipped: a sparse layer has no dense
    MLP), then its other layer linears one by one, then the linears of fused ops that are no family weight (a
    top.MoE's experts): one group per op, expert and input, keyed by the linears' roles."""
    key_of = {template.format(i=layer): key for key, template in family.layer_weights.items()}
    uses = linear_uses(function)
    linears = list(dict.fromkeys(use.weight for use in uses))  # in order of first use
    groups = [tuple(g) for g in family.quant_groups] or [(key_of[n],) for n in linears if n in key_of]
    # layers of different kinds (hybrid models) have different linears: a group none of whose linears this
    # layer has belongs to the other kind
    present = set(linears)
    groups = [g for g in groups if any(family.layer_weights[k].format(i=layer) in present for k in g)]
    covered = {k for g in groups for k in g}
    groups += [(key_of[n],) for n in linears if n in key_of and key_of[n] not in covered]
    names = [tuple(family.layer_weights[key].format(i=layer) for key in keys) for keys in groups]
    fused: dict[tuple[int, int | None, bool], list[Any]] = {}
    for use in uses:
        if use.weight not in key_of:
            fused.setdefault((id(use.op), use.linear.expert, use.input is None), []).append(use)
    for members in fused.values():
        groups.append(tuple(u.role for u in members))
        names.append(tuple(u.weight for u in members))
    sites = group_sites(function, names, lambda g: "/".join(groups[g]))
    return [_GroupPlan(groups[site.group], site.names, site.op, site.kind, site.k, site.fold, site.operand,
                       site.expert, site.hidden_from)
            for site in sites if site.group is not None]


# ================================================================================ running a layer


class _StopLayer(Exception):
    """Raised by the capture tap once the wanted input is seen: the rest of the layer is not needed."""


class _CaptureInterpreter(Interpreter):
    """The reference interpreter reading weights from a LayerState and feeding one group's input to InputStats."""

    def __init__(self, module: Any, state: LayerState) -> None:
        super().__init__(module, state.current_weight)
        self.state = state
        self._version = state.version
        self.plans_: list[_GroupPlan] = []
        self.stats: list[InputStats] = []
        self._at: Operation | None = None  # the op whose tap captures
        # reuse of earlier runs' values (`reuse`); None: every op runs
        self._values: LayerValues | None = None
        self._cache: Cache = {}
        self._execute: frozenset[int] = frozenset()
        self._keep: frozenset[int] = frozenset()
        self._narrow = False
        self.kept: Cache = {}

    def load_weight(self, op: Operation) -> np.ndarray:
        array = self.state.current_weight(op.attrs["name"])
        if tuple(array.shape) != tuple(op.results[0].type.shape):
            raise TopqError(f"weight {op.attrs['name']} has shape {list(array.shape)}, "
                            f"the program expects {list(op.results[0].type.shape)}")
        return array

    def capture(self, plans: Sequence[_GroupPlan], stats: Sequence[InputStats]) -> None:
        """Feed each plan's input to its stats (through the interpreter's tap) and stop the layer there; no plans:
        run it. Plans captured together share their capture point (`_batches`)."""
        self.plans_, self.stats = list(plans), list(stats)
        self._at = _capture_point(self.plans_[0]) if self.plans_ else None
        self.tap = self._capture if self.plans_ else None

    def reuse(self, values: LayerValues, cache: Cache, targets: frozenset[int], keep: frozenset[int],
              narrow: bool = False) -> None:
        """The next run takes the results of the ops in `cache` from it, executes only the other ops that
        `targets` need, and keeps (in `kept`) the results of the ops in `keep` for the run after it. `narrow`: keep
        a captured MLP act rounded to bf16 (`bf16_operand`), exact when its one reader, the down projection, is a
        bf16 product and no fold will divide the act."""
        self._values, self._cache, self._keep, self._narrow = values, cache, keep, narrow
        self._execute = values.needed(cache, targets)
        self.kept = {i: v for i, v in cache.items() if i in keep}

    def run_op(self, step: Step, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if self._values is None:
            return super().run_op(step, inputs)
        i = self._values.at(step.op)
        outs = self._cache.get(i)
        if outs is None:
            if i not in self._execute:  # nothing this run wants depends on it
                return [None] * len(step.results)  # type: ignore[list-item]
            act = self._cache.get(inner_key(i))
            if act is not None:  # the reference kernel's two parts (`mlp_hidden`, `mlp_down`); x was not computed
                assert step.kernel is REFERENCE_OPS["top.MLP"]
                outs = [mlp_down(act[0], inputs[3]).reshape(step.op.results[0].type.shape)]
            else:
                outs = super().run_op(step, inputs)
            if i in self._keep:
                self.kept[i] = outs
        return outs

    def run(self, name: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self.state.version != self._version:  # weights changed: rebuild plans (they hold the weight arrays)
            self._plans.clear()
            self._version = self.state.version
        return super().run(name, inputs)

    def _capture(self, step: Step, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        if not self.plans_ or step.op is not self._at:
            return
        routing = _routing(step.op, inputs) if any(p.expert is not None for p in self.plans_) else None
        for plan, stats in zip(self.plans_, self.stats):
            self._add(plan, stats, step, inputs, outputs, routing)
        raise _StopLayer

    def _add(self, plan: _GroupPlan, stats: InputStats, step: Step, inputs: list[np.ndarray],
             outputs: list[np.ndarray], routing: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        op, at_group = plan.op, step.op is plan.op
        if plan.expert is not None:  # at the op (see _capture_point): only the tokens routed to the expert
            assert routing is not None
            x2, chosen, weights = routing
            x = x2[moe_expert_tokens(chosen, weights, plan.expert)[0]]
            if plan.kind == INPUT:
                stats.add(x)
            else:
                stats.add(mlp_hidden(x, inputs[plan.hidden_from[1]], inputs[plan.hidden_from[2]],
                                     str(op.attrs.get("act", "silu")))[2])
        elif plan.kind == INPUT:
            stats.add(inputs[plan.operand] if at_group else outputs[op.operands[plan.operand].index])
        else:
            x_at, gate_at, up_at = plan.hidden_from
            if at_group:
                x, w_gate, w_up = inputs[x_at], inputs[gate_at], inputs[up_at]
            else:  # the weights are the plan's constants: the arrays the MLP would read
                x = outputs[op.operands[x_at].index]
                w_gate, w_up = (self.load_weight(_owner(op.operands[i])) for i in (gate_at, up_at))
            act = mlp_hidden(x, w_gate, w_up, str(op.attrs.get("act", "silu")))[2]
            stats.add(act)
            key = inner_key(self._values.at(op)) if self._values is not None else None
            if key in self._keep and act.dtype == np.float32 and w_gate.dtype == w_up.dtype == np.float32:
                # the op's own kernel would compute exactly this act (float32 operands)
                self.kept[key] = [bf16_operand(act) if self._narrow else act]


def _routing(op: Operation, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A top.MoE's input x as [tokens, H] and its routing (chosen experts, their weights), as the op computes it."""
    x = np.asarray(inputs[0], dtype=np.float32)
    x = x.reshape(-1, x.shape[-1])
    chosen, weights = moe_routing(x, inputs[1], int(op.attrs["top_k"]), str(op.attrs.get("scoring", "softmax")),
                                  bool(op.attrs.get("norm_topk_prob", False)))
    return x, chosen, weights


def _owner(value: Value) -> Operation:
    op = producer(value)
    assert op is not None
    return op


def _capture_point(plan: _GroupPlan) -> Operation:
    """The op after which the group's input is known: the producer of the linears' input, so that the linears (for
    top.MLP the whole fused MLP) need not run first; the group's own op when the input is a function argument, or
    when the group sees only routed tokens (the routing needs the op's router weight)."""
    x = plan.op.operands[plan.operand if plan.kind == INPUT else plan.hidden_from[0]]
    source = producer(x)
    if source is None or weight_name(x) is not None or plan.expert is not None:
        return plan.op
    if plan.kind != INPUT and any(weight_name(plan.op.operands[i]) is None for i in plan.hidden_from[1:]):
        return plan.op  # the hidden activation needs gate / up weights that are constants of the plan
    return source


GroupSolver = Callable[[GroupInputs, LayerState, Mapping[str, Any]], None]
#: `QuantScheme.solve`: (weights sharing an input, stacked [N, K], that input's statistics, options) → QuantizedWeight;
#: a solver with a `map` keyword also gets `GroupInputs.map` for its independent parts
WeightSolver = Callable[..., QuantizedWeight]


def stacked_solver(solve: WeightSolver) -> GroupSolver:
    """The group solver of a per-weight solver: the group's linears stacked along N, solved once (a solver driven by
    input statistics treats rows alike), split back, and — with `InputStats` — each one's output error logged
    beside RTN's through the same H (the calibration report)."""
    takes_map = "map" in inspect.signature(solve).parameters

    def solve_group(group: GroupInputs, state: LayerState, options: Mapping[str, Any]) -> None:
        weights = [state.float_weight(name) for name in group.names]
        extra = {"map": group.map} if takes_map else {}
        state.set_quantized_rows(group.names, solve(np.concatenate(weights, axis=0), group.stats, options, **extra))
        if isinstance(group.stats, InputStats):  # the error report is measured through H
            state.record(group.names, weights, [state.current_weight(n) for n in group.names],
                         group.stats.hessian(), options["bits"], options["group_size"], options["symmetric"],
                         group.map)

    return solve_group


Summarize = Callable[[np.ndarray], Any]


def summarizer(observer: Any) -> Summarize | None:
    """The observer's `summarize` if its class has one (`topq.core.quant.InputObserver`): picklable, so that any
    executor's tasks can run it."""
    summarize = getattr(type(observer), "summarize", None)
    return summarize if callable(summarize) and hasattr(observer, "add_summary") else None


class _Captured:
    """Stands in for a group's observer in a calibration task: keeps, per captured input, its token count and the
    input itself or — when the observer can summarize — its summary, for the parent to add in sample order."""

    def __init__(self, summarize: Summarize | None) -> None:
        self.summarize = summarize
        self.items: list[tuple[int, Any]] = []

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float32)
        tokens = int(np.prod(x.shape[:-1]))
        self.items.append((tokens, x if self.summarize is None else self.summarize(x)))


class _FixedWeights:
    """A LayerState's interface over one step's weights (what `_CaptureInterpreter` reads)."""

    version = 0

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights

    def current_weight(self, name: str) -> np.ndarray:
        return self.weights[name]


@dataclass
class _LayerStep:
    """One step of the layer loop, as its tasks see it: capture the inputs of some groups (None: the layer
    output) for some samples, with the layer's weights as they are now."""

    token: str  # unique: a worker keeps its interpreter for the step it last ran
    source: ProgramSource
    layer: int
    groups: tuple[int, ...] | None  # captured together (`_batches`); None: the layer output
    summarizers: tuple[Summarize | None, ...]  # per captured group: what a task sends back (`_Captured`)
    weights: dict[str, np.ndarray]  # every weight block_{layer} reads, as the model computes with it now
    changed: frozenset[str] = frozenset()  # weights written since the layer's previous step
    # kept value → the changed weights the loop already updated it for (`_divide_kept_input`)
    refreshed: Mapping[int, frozenset[str]] = field(default_factory=dict)
    pending: frozenset[str] = frozenset()  # weights of the groups not solved yet (this step's included)
    # tensors those groups' solvers may fold a scale into, where the loop computes the values after them again
    folds: frozenset[str] = frozenset()
    divides: bool = False  # some of those groups' folds divide a kept value instead (`_divide_kept_input`)
    hidden: np.ndarray | None = None  # every sample's layer input [samples, L, H] (executors that share memory)
    caches: list[Cache] | None = None  # every sample's values kept from the layer's previous steps (likewise)
    matmul: str = "f32"  # the products the tasks compute with (`quant.calibration_matmul`, `topq.ir.products`)


class _Steps(threading.local):
    """This thread's interpreter for the step it last ran (a worker process has one thread, `_ThreadTasks` more)."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {}


_STEPS = _Steps()
#: the block results the layer loop reads: the hidden state (not the K / V a block returns for the KV cache)
_HIDDEN = (0,)


class _ThreadTasks:
    """The layer loop's tasks on `jobs` threads of this process: its products release the GIL, and the threads
    read the layer inputs and kept values in place (a forked pool would fork per step and copy every result
    back). The same kernels on the same operands as in one thread: the same results."""

    name, shares_memory = "threads", True

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="topq-calibrate")

    def map(self, fn: Callable[..., Any], tasks: Sequence[tuple[Any, ...]]) -> Iterator[Any]:
        """Results in task order, with at most 2 × jobs tasks ahead of the consumer: finished results wait for it,
        and an input summary can be a [K, K] Gram per sample."""
        ahead: deque[Future[Any]] = deque()
        for task in tasks:
            if len(ahead) >= 2 * self.jobs:
                yield ahead.popleft().result()
            ahead.append(self._pool.submit(fn, *task))
        while ahead:
            yield ahead.popleft().result()

    def map_list(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """`GroupInputs.map` on these threads."""
        return list(self._pool.map(fn, items))

    def share(self, obj: Any) -> Any:
        return obj

    def release(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _step_runner(step: _LayerStep) -> tuple[_CaptureInterpreter, list[_GroupPlan] | None, LayerValues]:
    table = _STEPS.table
    if table.get("token") != step.token:
        module, family, spec = calibration_program(step.source)
        function = module[f"block_{step.layer}"]
        plans = None
        if step.groups is not None:
            found = _find_groups(function, family, spec, step.layer)
            plans = [found[g] for g in step.groups]
        table.clear()
        table.update(token=step.token, interp=_CaptureInterpreter(module, _FixedWeights(step.weights)),  # type: ignore[arg-type]
                     plans=plans, values=LayerValues.of(function, read=_HIDDEN))
    return table["interp"], table["plans"], table["values"]


def _layer_task(step_handle: Any, start: int, stop: int, rows: np.ndarray | None,
                caches: list[Cache] | None) -> list[tuple[Any, Cache]]:
    """A calibration task: for samples start..stop, the inputs the step's groups see (a list of one array per
    group), or the layer's output (an array), per sample, each with the values the next run of the layer can
    reuse (`topq.quant.reuse`). `rows` / `caches` are those samples' layer inputs and values kept by the layer's
    previous runs, unless the step carries them all (`hidden`, `caches`)."""
    step: _LayerStep = resolve(step_handle)
    threads = fixed_threads() or 1  # parallel are the tasks (`jobs`); a BLAS pool would only compete
    with blas_threads(threads), torch_threads(step.matmul, threads), products(step.matmul):
        return _run_layer_task(step, start, stop, rows, caches)


def _run_layer_task(step: _LayerStep, start: int, stop: int, rows: np.ndarray | None,
                    caches: list[Cache] | None) -> list[tuple[Any, Cache]]:
    interp, plans, values = _step_runner(step)
    hidden = rows if rows is not None else step.hidden[start:stop]  # type: ignore[index]
    caches = caches if caches is not None else step.caches[start:stop]  # type: ignore[index]
    positions = np.arange(step.source.seq_len, dtype=np.int32)[None]
    name = f"block_{step.layer}"
    # a recurrent layer's prefill also takes `valid` (stages.py): every calibration token is real
    valid = [np.ones((1, step.source.seq_len), np.float32)] if len(interp.module[name].args) == 3 else []
    if plans is None:  # the layer's output: its hidden state (not the K / V it also returns for the caches)
        hidden_out = frozenset({values.at(_owner(interp.module[name].results[0]))})
        out = []
        for h, cache in zip(hidden, caches):
            interp.reuse(values, values.still_valid(cache, step.changed, step.refreshed), hidden_out, frozenset())
            out.append((interp.run(name, [h[None], positions, *valid])[0][0], {}))
        return out
    captured = [_Captured(summarize) for summarize in step.summarizers]
    interp.capture(plans, captured)  # type: ignore[arg-type]
    targets = _capture_targets(plans[0], values)
    keep = values.frontier(step.pending) | values.frontier(step.pending | step.folds)
    narrow = step.matmul == "bf16" and not step.folds and not step.divides
    kept = []
    try:
        for h, cache in zip(hidden, caches):
            interp.reuse(values, values.still_valid(cache, step.changed, step.refreshed), targets, keep, narrow)
            try:
                interp.run(name, [h[None], positions, *valid])
            except _StopLayer:
                pass
            kept.append(interp.kept)
    finally:
        interp.capture([], [])
    return [([c.items[i] for c in captured], kept[i]) for i in range(len(hidden))]


def _capture_targets(plan: _GroupPlan, values: LayerValues) -> frozenset[int]:
    """The ops a run up to the plan's capture point must produce: the tap reads the capture op's operands and
    results."""
    at = values.at(_capture_point(plan))
    return frozenset((at, *values.producers[at]))


def _store_in_input(hidden: np.ndarray, s: int, cache: Cache, values: LayerValues, later: Iterable[int],
                    lasting: Iterable[int], stored: list[int | None]) -> None:
    """Once the layer's later runs (their `later` targets) need not read sample s's layer input — computed from
    the kept values `lasting` until then — keep a kept value of the same shape, the earliest (the residual stream),
    in that row of `hidden` instead of beside it: [samples, L, H] float32 less at the layer loop's peak. `stored`:
    the key stored so (per layer)."""
    row = hidden[s]
    key = stored[0]
    if key is not None and key in cache and np.may_share_memory(cache[key][0], row):
        return
    if values.reads_input(lasting, later):
        return
    fits = [k for k in sorted(cache) if k >= 0 and len(cache[k]) == 1 and cache[k][0].shape == (1, *row.shape)
            and cache[k][0].dtype == row.dtype]
    if fits:
        key = key if key in fits else fits[0]
        row[...] = cache[key][0][0]
        cache[key] = [row[None]]
        stored[0] = key


def _chunk_size(executor: TaskExecutor, samples: int) -> int:
    """Samples per task: one in this process or on its threads (nothing to amortise, memory stays at a few
    samples); else a few tasks per worker, enough to balance the load while keeping the per-task overhead small."""
    if isinstance(executor, InlineExecutor | _ThreadTasks):
        return 1
    return max(1, math.ceil(samples / (4 * max(1, int(executor.jobs)))))


def _map_samples(executor: TaskExecutor, step: _LayerStep, hidden: np.ndarray, caches: list[Cache],
                 chunk: int) -> Iterator[Any]:
    """Run `step` on every sample through `executor`; the per-sample results, in sample order. Each sample's
    values for the layer's next run replace its entry of `caches`."""
    if executor.shares_memory:
        step.hidden, step.caches = hidden, caches
    handle = executor.share(step)
    try:
        tasks = [(handle, a, min(a + chunk, len(hidden)),
                  None if executor.shares_memory else np.ascontiguousarray(hidden[a:a + chunk]),
                  None if executor.shares_memory else caches[a:a + chunk])
                 for a in range(0, len(hidden), chunk)]
        s = 0
        for result in executor.map(_layer_task, tasks):
            for out, kept in result:
                caches[s] = kept
                s += 1
                yield out
    finally:
        step.hidden = step.caches = None
        executor.release(handle)


def _embed(module: Any, state: LayerState, windows: np.ndarray) -> np.ndarray:
    """Every sample's input of layer 0 [samples, L, H]. The embedding table's float copy (the interpreter's plan
    and the state's cache hold it) is dropped before the layers run: no layer reads it."""
    interp = _CaptureInterpreter(module, state)
    first = interp.run("embedding", [windows[:1]])[0][0]
    hidden = np.empty((len(windows), *first.shape), first.dtype)
    hidden[0] = first
    for s in range(1, len(windows)):
        hidden[s] = interp.run("embedding", [windows[s:s + 1]])[0][0]
    state.end_layer()
    return hidden


def _weights_read(function: Function) -> list[str]:
    return list(dict.fromkeys(str(op.attrs["name"]) for op in function.walk() if op.name == "top.Weight"))


def run_calibration(model: LoadedModel, windows: np.ndarray, solve: GroupSolver, options: Mapping[str, Any],
                    progress: bool = True, desc: str = "calibrate", executor: TaskExecutor | None = None,
                    observe: Callable[[int], Any] = InputStats, expert_fallback: bool = True,
                    layer_tuner: LayerTuner | None = None, folds: bool = False,
                    spill_dir: str | Path | None = None) -> CalibrationResult:
    """Quantize every decoder-layer linear of `model` with `solve`, layer by layer (see the module doc).

    `folds`: `solve` may fold group input scales into earlier ops (`GroupInputs.fold`; AWQ), so the loop also keeps
    the values such a fold makes it compute again (none for a fold whose kept input it divides instead:
    `_divide_kept_input`), and keeps the MLP act in float32 (a fold divides it). A solver
    that folds without saying so still gets correct values (what a write touched is computed again or divided, never
    stale), but not always the bits of the run that was told.

    A routed expert's group (top.MoE) is solved on the tokens routed to it; with `expert_fallback` one that
    received fewer than `expert_min_tokens` is rounded to nearest instead (`_solve_expert`).

    The per-sample work — running the layer up to a group's input, and the quantized layer's forward — runs as
    tasks on `executor` (default: this process). Tasks return the captured inputs (or, for an observer with a
    `summarize`, each input's summary: `InputStats`' Gram products then run in the tasks) and the outputs, and this
    process adds them to the statistics in sample order, so every float sum happens in the same order whatever ran
    the tasks (identical results for any executor and job count). The solvers run here, between steps; each step's tasks
    get the layer's weights as they are at that point (`TaskExecutor.share`) and compute their linears and Grams
    with `options["calibration_matmul"]`'s products (`topq.ir.products`; default float32 numpy). `observe(k)`
    makes each group's statistics (`GroupInputs.stats`; default `InputStats`).

    A layer that `layer_tuner` covers is quantized by it as a whole instead of group by group. Its objective is
    the float model's output of the layer, so while any layer is tuned so, the loop carries the float model's
    hidden states beside the quantized model's: the tuner returns them for its layers, and a layer it does not
    cover computes them with its float weights (one more pass over the samples).

    Each finished layer's quantized values go to a temporary file in `spill_dir` (default: the temporary
    directory), read back through maps (`topq.quant.spill`), so that they do not add up in memory."""
    executor = executor if executor is not None else InlineExecutor()
    keep_freed_memory()  # every layer allocates the same large temporaries again (forked workers inherit it)
    windows = np.asarray(windows, dtype=np.int32)
    samples, seq_len = windows.shape
    spec, family = model.spec, model.family
    source = program_source(model, seq_len)
    module, _, _ = calibration_program(source, family, spec)
    spill = Spill(spill_dir)
    state = LayerState(model.weight, rope_weights(spec, seq_len), scale_dtype=str(options.get("act_dtype", "f32")),
                       spill=spill)
    hidden = _embed(module, state, windows)
    plans = [_find_groups(module[f"block_{i}"], family, spec, i) for i in range(spec.num_layers)]
    for plan in (p for layer_plans in plans for p in layer_plans):  # fail before hours of calibration, not after
        resolve_group_size(options.get("group_size"), plan.k, what=" / ".join(plan.names))
    # a local pool's jobs run the layer loop's tasks as threads of this process; every product on one BLAS thread,
    # whoever runs it, so that the results do not depend on the executor or the job count
    tasks = _ThreadTasks(executor.jobs) if executor.name == "local" and executor.jobs > 1 else executor
    chunk = _chunk_size(tasks, samples)
    solver_map = tasks.map_list if isinstance(tasks, _ThreadTasks) else serial_map
    tuned = [layer_tuner is not None and layer_tuner.covers(module[f"block_{i}"], options)
             for i in range(spec.num_layers)]
    float_hidden = hidden.copy() if any(tuned) else None  # the float model's inputs of the next layer
    bar = progress_bar(total=sum(len(p) + 1 for p in plans), desc=desc, unit="group", disable=not progress)
    kind, threads = str(options.get("calibration_matmul") or "f32"), fixed_threads() or 1
    with blas_threads(threads), torch_threads(kind, threads), products(kind):
        try:
            for layer, layer_plans in enumerate(plans):
                reads = _weights_read(module[f"block_{layer}"])
                values = LayerValues.of(module[f"block_{layer}"], read=_HIDDEN)
                caches: list[Cache] = [{} for _ in range(samples)]  # per sample: values the next run reuses
                read_at = [state.version]
                refreshed: dict[int, frozenset[str]] = {}  # kept values divided by a fold since the last step
                stored: list[int | None] = [None]  # the kept value `_store_in_input` keeps in `hidden`

                def step(groups: tuple[int, ...] | None, summarizers: tuple[Summarize | None, ...] = (),
                         layer: int = layer, reads: list[str] = reads, layer_plans: list[_GroupPlan] = layer_plans,
                         read_at: list[int] = read_at, refreshed: dict[int, frozenset[str]] = refreshed,
                         values: LayerValues = values, caches: list[Cache] = caches,
                         stored: list[int | None] = stored) -> _LayerStep:
                    rest = layer_plans[groups[0]:] if groups is not None else []
                    changed, read_at[0] = state.written_since(read_at[0]), state.version
                    up_to_date = dict(refreshed)
                    refreshed.clear()
                    targets = values.outputs if groups is None else _capture_targets(layer_plans[groups[0]], values)
                    if stored[0] is not None and values.reads_input(
                            values.still_valid(caches[0], changed, up_to_date), targets):
                        raise TopqError(f"layer {layer}: a solver changed weights that values computed from the "
                                        "layer input depend on, after the layer loop stopped keeping that input")
                    folding = [p for p in rest if p.fold and folds]
                    divided = [_divided_key(p, values) is not None for p in folding]
                    return _LayerStep(uuid.uuid4().hex, source, layer, groups, summarizers,
                                      {n: state.current_weight(n) for n in reads}, changed, up_to_date,
                                      frozenset(n for p in rest for n in p.names),
                                      frozenset().union(*(_fold_tensors(p) for p, d in zip(folding, divided) if not d)),
                                      any(divided), matmul=kind)

                if tuned[layer]:
                    assert layer_tuner is not None and float_hidden is not None
                    bar.set_postfix_str(f"layer {layer}")
                    float_hidden = layer_tuner.tune(LayerInputs(
                        layer, module, f"block_{layer}", hidden, float_hidden,
                        tuple(n for p in layer_plans for n in p.names), solver_map), state, options)
                    bar.update(len(layer_plans))
                elif float_hidden is not None:  # before any weight of the layer changes: its float outputs
                    fresh: list[Cache] = [{} for _ in range(samples)]
                    for s, out in enumerate(_map_samples(tasks, step(None), float_hidden, fresh, chunk)):
                        float_hidden[s] = out
                for batch in [] if tuned[layer] else _batches(layer_plans):
                    bar.set_postfix_str(f"layer {layer} {'/'.join(layer_plans[batch[0]].keys)}")
                    stats = [observe(layer_plans[g].k) for g in batch]
                    summarizers = tuple(summarizer(st) for st in stats)
                    tokens = [0] * len(batch)
                    # what the layer's later runs read, and the kept values that stay valid until then
                    later = values.outputs.union(*(_capture_targets(p, values) for p in layer_plans[batch[-1] + 1:]))
                    folding = [p for p in layer_plans[batch[0]:] if p.fold and folds]
                    changing = frozenset(n for p in layer_plans[batch[0]:] for n in p.names).union(
                        *(_fold_tensors(p) for p in folding))
                    divided = {k: _fold_tensors(p) for p in folding if (k := _divided_key(p, values)) is not None}
                    for s, xs in enumerate(_map_samples(tasks, step(batch, summarizers), hidden, caches, chunk)):
                        _store_in_input(hidden, s, caches[s], values, later, values.still_valid(
                            caches[s], changing, divided), stored)
                        for i, (st, summarize, (seen, x)) in enumerate(zip(stats, summarizers, xs)):
                            if summarize is None:
                                st.add(x)
                            else:  # the task summarized x (`_Captured`)
                                st.add_summary(x)
                            tokens[i] += seen
                    for g, st, seen in zip(batch, stats, tokens):
                        plan = layer_plans[g]
                        group = GroupInputs(layer, plan.keys, plan.names, st, plan.fold, seen, solver_map)
                        if plan.expert is None:
                            solve(group, state, options)
                        else:
                            _solve_expert(group, plan.expert, state, options, solve, expert_fallback)
                        scales = state.take_input_scales()
                        if plan.fold is not None and plan.fold.weight in scales:
                            refreshed.update(_divide_kept_input(plan, values, caches, scales[plan.fold.weight]))
                        bar.update()
                # the quantized layer's output is the next layer's input
                for s, out in enumerate(_map_samples(tasks, step(None), hidden, caches, chunk)):
                    hidden[s] = out
                del caches
                state.end_layer()
                bar.update()
        finally:
            bar.close()
            spill.close()
            _STEPS.table.clear()
            if tasks is not executor:
                tasks.close()
    return state.result


def _divide_kept_input(plan: _GroupPlan, values: LayerValues, caches: list[Cache],
                       s: np.ndarray) -> dict[int, frozenset[str]]:
    """A fold into a linear's rows made the plan's input x / s (`LayerState.fold_input_scale`): divide every sample's
    kept x by s, and say which weights' change that accounts for (the fold's). That saves attention over v, or the
    MLP's gate / up and act. Nothing for a fold into a norm (its output costs one pass to compute again, exactly) or
    when x is not kept as an op's only result: then the values that depend on the folded weight are dropped and
    computed again, as for any write."""
    assert plan.fold is not None
    key = _divided_key(plan, values)
    if key is None:
        return {}
    inv = (1.0 / np.asarray(s, dtype=np.float64)).astype(np.float32)
    for cache in caches:
        kept = cache.get(key)
        if kept is not None:
            cache[key] = [(kept[0].astype(np.float32, copy=False) * inv).astype(kept[0].dtype, copy=False)]
    return {key: _fold_tensors(plan)}


def _fold_tensors(plan: _GroupPlan) -> frozenset[str]:
    """The tensors the plan's solver may fold its input scale into."""
    return frozenset(n for n in (plan.fold.weight, plan.fold.bias) if n) if plan.fold is not None else frozenset()


def _divided_key(plan: _GroupPlan, values: LayerValues) -> int | None:
    """The kept value that `_divide_kept_input` divides after the plan's fold, if the fold is one it handles so."""
    if plan.fold is None or plan.fold.kind != "rows":
        return None
    if plan.kind != INPUT:  # the MLP act inside the op (`inner_key`)
        return inner_key(values.at(plan.op))
    x = plan.op.operands[plan.operand]
    source = producer(x)
    if source is None or weight_name(x) is not None or len(source.results) != 1:
        return None
    return values.at(source)


def _batches(plans: Sequence[_GroupPlan]) -> list[tuple[int, ...]]:
    """Consecutive groups captured in one pass over the samples: the routed experts of one op with the same kind of
    input (every expert's gate/up, then every expert's down). Solving one does not change another's input (x
    precedes the op; expert e's hidden depends only on its own gate/up, all solved before the downs), so this is
    the sequential result with one layer pass instead of one per expert; every other group is a pass of its own."""
    batches: list[list[int]] = []
    for g, plan in enumerate(plans):
        last = plans[batches[-1][-1]] if batches else None
        if last is not None and plan.expert is not None and last.expert is not None and last.op is plan.op \
                and last.kind == plan.kind:
            batches[-1].append(g)
        else:
            batches.append([g])
    return [tuple(b) for b in batches]


def _solve_expert(group: GroupInputs, expert: int, state: LayerState, options: Mapping[str, Any],
                  solve: GroupSolver, fallback: bool) -> None:
    """A routed expert's group: solved on the tokens routed to it, or — `fallback` and fewer than
    `expert_min_tokens` of them (too few to estimate its input statistics) — rounded to nearest; either way each
    linear's report row says how many tokens the expert received (its coverage), and a fallback says so in
    `mode` and `fallback`. Without `fallback` (the RTN error report) an expert no token reached has no error."""
    tokens = group.tokens
    minimum = int(options.get("expert_min_tokens") or EXPERT_MIN_TOKENS) if fallback else 1
    first = len(state.result.report)
    if tokens >= minimum:
        solve(group, state, options)
        for row in state.result.report[first:]:
            row.update(expert=expert, tokens=tokens)
        return
    if not fallback:
        state.result.report += [{"name": name, "error": None, "expert": expert, "tokens": 0} for name in group.names]
        return
    bits, symmetric = int(options.get("bits") or 4), bool(options.get("symmetric", False))
    for name in group.names:
        w = state.float_weight(name)
        qw = quantize_groups(w, check_bits(bits), resolve_group_size(options.get("group_size"), w.shape[1]),
                             symmetric)
        state.set_quantized(name, qw)
        measured = tokens and isinstance(group.stats, InputStats)
        error = relative_output_error(w, state.current_weight(name), group.stats.hessian()) if measured else None
        state.result.report.append({"name": name, "mode": "rtn", "error": error, "expert": expert,
                                    "tokens": tokens, "fallback": f"rtn: {tokens} calibration tokens routed to "
                                                                  f"expert {expert}, fewer than {minimum}"})


def relative_output_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """||X Wᵀ - X Ŵᵀ||_F / ||X Wᵀ||_F over the inputs whose H = mean xᵀx is `h` (0 for a zero output)."""
    error = float(output_error(w, w_hat, h).sum())
    reference = float(output_error(w, np.zeros_like(w), h).sum())
    return float(np.sqrt(error / reference)) if reference > 0 else 0.0


def quantization_report(model: LoadedModel, recipe: Recipe, scheme: QuantScheme,
                        executor: TaskExecutor | None = None) -> CalibrationResult:
    """For a scheme that quantizes weight by weight (`scheme.quantize`: RTN), the calibration report only: per
    decoder linear, the relative output error of its quantized weight on the calibration windows.

    The layer loop runs on the float model (nothing is published, so every layer sees the float model's
    inputs, which are also what the RTN weights were chosen without). Returns a result with no values."""
    assert scheme.quantize is not None
    quant = recipe.to_dict()["quant"]
    options = {k: v for k, v in quant.items() if v is not None}
    options["act_dtype"] = scheme.produces(quant).compute_dtype
    quantize = scheme.quantize

    def report(group: GroupInputs, state: LayerState, _options: Mapping[str, Any]) -> None:
        h = group.stats.hessian()
        for name in group.names:
            w = state.float_weight(name)
            error = relative_output_error(w, quantize(w, options).dequantize(), h)
            state.result.report.append({"name": name, "error": error})

    windows = calibration_windows(model, recipe)
    return run_calibration(model, windows, report, options, desc=f"{scheme.name} error", executor=executor,
                           expert_fallback=False)


# ================================================================================ schemes


def weight_options(quant: Mapping[str, Any], scheme: str) -> dict[str, Any]:
    """The options every calibrated weight-only scheme reads (bits, group_size, symmetric, act_dtype,
    calibration_matmul), checked and defaulted; a scheme adds its own (`calibration_scheme`'s `read_options`)."""
    bits = 4 if quant.get("bits") is None else int(quant["bits"])
    if bits not in (4, 8):
        raise TopqError(f"quant.bits must be 4 or 8 for scheme {scheme}, got {bits}")
    return {"bits": bits, "group_size": int(quant["group_size"]), "symmetric": bool(quant["symmetric"]),
            "act_dtype": act_dtype(quant),
            "calibration_matmul": check_kind(str(quant.get("calibration_matmul") or "f32"),
                                             "quant.calibration_matmul"),
            "expert_min_tokens": int(quant.get("expert_min_tokens") or EXPERT_MIN_TOKENS)}


def calibration_scheme(name: str, description: str, *, solve: WeightSolver | None = None,
                       group_solver: GroupSolver | None = None, observe: Callable[[int], Any] = InputStats,
                       own_options: tuple[Option, ...] = (),
                       read_options: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda quant: {},
                       layer_tuner: LayerTuner | None = None, folds: bool = False) -> QuantScheme:
    """A weight-only QuantScheme whose `calibrate` runs the layer loop: each quant group's input statistics
    (`observe`, default `InputStats`) go to `solve` (`QuantScheme.solve`: stacked weights → QuantizedWeight) or, for
    a scheme that rewrites more than the group's weights (AWQ folds scales into the previous op), to `group_solver`
    (reads and publishes through `LayerState`). Exactly one of the two is given. A `layer_tuner` quantizes the
    layers it covers as a whole instead (`run_calibration`). `folds`: the group solver folds input scales into
    earlier ops (AWQ), so the layer loop keeps what it needs to bring its kept values up to date cheaply.

    `own_options` are the scheme's recipe options beside bits / group_size / symmetric / act_dtype;
    `read_options(quant)` checks and defaults them (the solver gets both). The scheme produces `bits`-bit weights
    computed in `act_dtype` (default bf16). The rewritten float tensors (`CalibrationResult.float_weights`) are
    installed by the pipeline (`make_quantizer`) in `model.extra_weights`, which `LoadedModel.weight` reads before
    the checkpoint."""
    if (solve is None) == (group_solver is None):
        raise TopqError(f"quant scheme {name!r}: give calibration_scheme one of solve= and group_solver=")
    solve_group = group_solver or stacked_solver(solve)  # type: ignore[arg-type]  # one of the two is set

    def options_of(quant: Mapping[str, Any]) -> dict[str, Any]:
        return {**weight_options(quant, name), **read_options(quant)}

    def product(quant: Mapping[str, Any]) -> SchemeProduct:
        bits = 4 if quant.get("bits") is None else int(quant["bits"])
        own = read_options(quant)  # act_order permutes the groups (a g_idx) unless they are static
        return SchemeProduct(act_dtype(quant), (bits,),
                             act_order=bool(own.get("act_order")) and not own.get("static_groups"))

    def calibrate(model: LoadedModel, recipe: Recipe, *, executor: TaskExecutor | None = None) -> CalibrationResult:
        options = options_of(recipe.to_dict()["quant"])
        windows = calibration_windows(model, recipe)
        return run_calibration(model, windows, solve_group, options, desc=name, executor=executor, observe=observe,
                               layer_tuner=layer_tuner, folds=folds, spill_dir=spill_directory(recipe.output.path))

    def quantize(weight: np.ndarray, options: Mapping[str, Any]) -> QuantizedWeight:
        # Weights outside the decoder layers (e.g. `quant.lm_head: gptq`) have no calibration: round to nearest.
        bits = options.get("bits") or 4
        return quantize_groups(weight, check_bits(bits), resolve_group_size(options.get("group_size"),
                                                                             weight.shape[1]),
                               bool(options.get("symmetric", False)))

    return QuantScheme(name, description, compute_dtype="bf16", weight_bits=4,
                       options=(*WEIGHT_OPTIONS, ACT_DTYPE, CALIBRATION_MATMUL, EXPERT_MIN_TOKENS_OPTION,
                                *own_options),
                       needs_calibration=True, quantize=quantize, calibrate=calibrate, product=product,
                       observe=observe, solve=solve)
