"""Building a bundle's tensors at scale: split into units, compile units in parallel, cache them by content.

A *unit* is the tensors of one transformer layer (`…layers.{i}.…`), or the rest (embedding, lm_head, tables).
Each unit compiles on its own (in this process, a process pool or a Ray cluster: `executors.py`) into a
safetensors file in the build cache, named by a content hash of the unit's Top IR, the checkpoint weights it
reads, the recipe's relevant part and the topq version. The bundle is then streamed from those files in a fixed
order, so the result is byte-identical whatever ran the units, and an interrupted or repeated conversion
reuses every unit already built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import topq
from topq.core.calibration_result import CalibrationResult, save_calibration
from topq.core.checkpoint import WeightStore
from topq.core.errors import TopqError
from topq.core.executors import InlineExecutor, TaskExecutor
from topq.core.progress import progress_bar
from topq.core.target import CompiledModel
from topq.io.safetensors import SafetensorsFile, SafetensorsWriter, TensorData
from topq.ir.printer import print_function

if TYPE_CHECKING:
    from topq.core.pipeline import LoadedModel

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
GLOBAL_UNIT = "globals"


def unit_of(name: str) -> str:
    match = _LAYER_RE.search(name)
    return f"layer_{int(match.group(1))}" if match else GLOBAL_UNIT


def split_units(names: Sequence[str]) -> dict[str, list[str]]:
    """Tensor names grouped by unit: the global unit first, then layers in order."""
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(unit_of(name), []).append(name)
    order = sorted(units, key=lambda u: (-1 if u == GLOBAL_UNIT else int(u.split("_")[1])))
    return {u: units[u] for u in order}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TOPQ_CACHE_DIR") or Path.home() / ".cache" / "topq")


# ---------------------------------------------------------------------------------------------- per process


@dataclass
class Prepared:
    """One process's view of a conversion: the loaded model and the target's compiled program."""

    model: LoadedModel
    compiled: CompiledModel
    recipe: dict[str, Any]
    quant_report: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: what the scheme's calibration returned (empty for schemes that do not calibrate)
    calibration: CalibrationResult = dataclasses.field(default_factory=CalibrationResult)
    calibration_file: str | None = None  # where that result is stored for workers that cannot inherit it


def recipe_key(recipe: dict[str, Any]) -> str:
    """The recipe without its output path: what decides the tensors."""
    relevant = {k: v for k, v in recipe.items() if k != "output"}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def store_calibration(prepared: Prepared, cache_dir: Path | None) -> Path | None:
    """Store the calibration result for workers that do not share this process's memory (`pipeline.compile_unit`
    loads it); return the directory to delete after the conversion (None: nothing to store)."""
    if prepared.calibration.empty:
        return None
    parent = None
    if cache_dir is not None:  # the cache is where workers already read and write (a shared file system)
        parent = cache_dir / "calibration"
        parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="topq-calibration-", dir=parent))
    path = directory / "calibration.safetensors"
    save_calibration(prepared.calibration, path)
    prepared.calibration_file = str(path)
    return directory


def write_unit(prepared: Prepared, names: list[str], out_path: str) -> str:
    """Produce the tensors `names` of a prepared conversion and store them at `out_path` (atomically)."""
    types = prepared.compiled.manifest
    manifest = [(n, types[n].np_dtype, types[n].shape) for n in names]
    digests = {f"sha256:{n}": "0" * 64 for n in names}  # fixed width: the header is rewritten in place
    with SafetensorsWriter(out_path, manifest, digests) as writer:
        for name, array in prepared.compiled.produce(names):
            digests[f"sha256:{name}"] = writer.write(name, array)
        writer.finish(digests)
    return out_path


#: A build task (run by an executor, maybe in another process): (recipe dict, tensor names, output path,
#: calibration file) → output path. The pipeline supplies it, because a worker may have to prepare the conversion.
UnitTask = Callable[[dict[str, Any], list[str], str, str | None], str]


# ---------------------------------------------------------------------------------------------- keys


def _fingerprint(store: WeightStore, name: str | None) -> str:
    if name is None or name not in store:
        return "synthesised"
    return store.fingerprint(name)


def _file_fingerprint(path: str | None) -> str:
    if not path or not Path(path).exists():
        return "none"
    p = Path(path)
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    return ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file())


def unit_keys(prepared: Prepared, units: dict[str, list[str]]) -> dict[str, str]:
    model, compiled, recipe = prepared.model, prepared.compiled, prepared.recipe
    relevant = {k: recipe.get(k) for k in ("quant", "target", "kernels")}
    relevant["model"] = {k: v for k, v in recipe["model"].items() if k != "path"}
    common = json.dumps([topq.__version__, relevant, _file_fingerprint(recipe["quant"]["calibration"].get("data")),
                         _file_fingerprint(recipe["quant"].get("table"))], sort_keys=True)
    functions: dict[str, list[str]] = {}
    for function in model.module:
        layer = function.attrs.get("layer")
        functions.setdefault(GLOBAL_UNIT if layer is None else f"layer_{layer}", []).append(print_function(function))
    store = model.checkpoint.weights
    keys = {}
    for unit, names in units.items():
        h = hashlib.sha256(common.encode())
        for text in functions.get(unit, []):
            h.update(text.encode())
        for name in names:
            h.update(f"{name}:{compiled.manifest[name]}:{_fingerprint(store, compiled.source_of(name))}".encode())
        keys[unit] = h.hexdigest()
    return keys


# ---------------------------------------------------------------------------------------------- driver


def _unit_damage(path: Path, names: Sequence[str], manifest: dict[str, Any]) -> str | None:
    """Why a cached unit cannot be copied into a bundle (None: sound). Its tensors go in by their stored digests
    without being read again, so every byte is checked here against those digests before reuse."""
    try:
        unit = SafetensorsFile(path)
    except (TopqError, OSError, ValueError) as exc:
        return str(exc)
    if unit.names() != list(names):
        return "its tensors are not the unit's"
    for name in names:
        array = unit.get_raw(name)
        if array.dtype != manifest[name].np_dtype or tuple(array.shape) != tuple(manifest[name].shape):
            return f"tensor {name} has the wrong type"
        digest = hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data).hexdigest()
        if digest != unit.metadata.get(f"sha256:{name}"):
            return f"tensor {name} does not match its checksum"
    return None


def _reusable(path: Path, names: Sequence[str], manifest: dict[str, Any]) -> bool:
    """A cached unit that exists and is sound; a damaged one is removed (it is rebuilt) with a warning."""
    if not path.exists():
        return False
    damage = _unit_damage(path, names, manifest)
    if damage is None:
        return True
    print(f"warning: build cache unit {path} is damaged ({damage}); rebuilding it", file=sys.stderr)
    path.unlink(missing_ok=True)
    return False


@dataclass
class BuildStats:
    units: int = 0
    built: int = 0
    reused: int = 0


def bundle_tensors(prepared: Prepared, executor: TaskExecutor, cache_dir: Path | None, stats: BuildStats,
                   task: UnitTask,
                   ) -> tuple[list[tuple[str, Any, tuple[int, ...]]], Iterator[tuple[str, TensorData]]]:
    """(manifest in bundle order, the tensors to stream). Builds missing units first (each with `task`); without a
    cache and in this process, tensors stream straight from the compiler."""
    manifest = prepared.compiled.manifest
    units = split_units(list(manifest))
    order = [(n, manifest[n].np_dtype, manifest[n].shape) for names in units.values() for n in names]
    stats.units = len(units)
    if cache_dir is None and isinstance(executor, InlineExecutor):
        stats.built = len(units)
        names = [n for names in units.values() for n in names]
        return order, prepared.compiled.produce(names)

    scratch = None
    if cache_dir is None:
        cache_dir = Path(scratch := tempfile.mkdtemp(prefix="topq-build-"))
    directory = cache_dir / "units"
    directory.mkdir(parents=True, exist_ok=True)
    keys = unit_keys(prepared, units)
    paths = {unit: directory / f"{keys[unit]}.safetensors" for unit in units}
    todo = [unit for unit in units if not _reusable(paths[unit], units[unit], manifest)]
    stats.built, stats.reused = len(todo), len(units) - len(todo)
    tasks = [(prepared.recipe, units[unit], str(paths[unit]), prepared.calibration_file) for unit in todo]
    for _ in progress_bar(executor.map(task, tasks), total=len(tasks), desc=f"compile units ({executor.name})",
                          unit="unit", disable=not tasks):
        pass

    def stream() -> Iterator[tuple[str, TensorData]]:
        try:
            for unit, names in units.items():
                built = SafetensorsFile(paths[unit])
                for name in names:
                    piece = built.slice_of(name)
                    yield name, dataclasses.replace(piece, sha256=built.metadata.get(f"sha256:{name}"))
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    return order, stream()
