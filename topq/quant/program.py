"""The calibration program — every stage function runs one window of `seq_len` tokens — and the one way a worker
that shares no memory with the converting process rebuilds it (and, when it reads weights itself, opens the
checkpoint): from a JSON-able `ProgramSource`. Calibration (GPTQ/AWQ/AutoRound) ships a layer's weights with each
step; int8's observers read the float checkpoint by path."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from topq.core.checkpoint import WeightStore
from topq.core.family import ModelFamily, ModelSpec
from topq.core.stages import StageConfig, build_program
from topq.ir.graph import Module

if TYPE_CHECKING:
    from topq.core.pipeline import LoadedModel


@dataclass(frozen=True)
class ProgramSource:
    """What builds the calibration program of a model, JSON-able. `key` identifies the program (not the
    checkpoint: two checkpoints of the same shapes share it)."""

    key: str
    family: str
    spec: dict[str, Any]
    seq_len: int
    shapes: dict[str, list[int]]
    checkpoint: str
    format: str


def program_source(model: LoadedModel, seq_len: int) -> ProgramSource:
    store = model.checkpoint.weights
    shapes = {name: [int(d) for d in store.shape(name)] for name in store.names()}
    spec = model.spec.to_dict()
    key = json.dumps([model.family.name, spec, seq_len, shapes], sort_keys=True, default=str)
    return ProgramSource(hashlib.sha256(key.encode()).hexdigest(), model.family.name, spec, seq_len, shapes,
                         str(model.checkpoint.path), model.checkpoint.format)


def build_calibration_program(source: ProgramSource, family: ModelFamily | None = None,
                              spec: ModelSpec | None = None) -> tuple[Module, ModelFamily, ModelSpec]:
    """(module, family, spec), freshly built (the caller may rewrite it); `family` / `spec` when the caller has
    them, else from the registered plugins and the source."""
    if family is None:
        from topq.core.plugins import get_plugins

        family = get_plugins().families.get(source.family)
    spec = spec if spec is not None else ModelSpec.from_dict(source.spec)
    shapes = {name: tuple(shape) for name, shape in source.shapes.items()}
    module = build_program(spec, family, StageConfig(source.seq_len, source.seq_len, False, ()), shapes)
    return module, family, spec


#: calibration programs built in this process (forked workers inherit the parent's), by source key
_PROGRAMS: dict[str, tuple[Module, ModelFamily, ModelSpec]] = {}


def calibration_program(source: ProgramSource, family: ModelFamily | None = None,
                        spec: ModelSpec | None = None) -> tuple[Module, ModelFamily, ModelSpec]:
    """`build_calibration_program`, built once per process and program (shared: callers must not rewrite it)."""
    cached = _PROGRAMS.get(source.key)
    if cached is None:
        while len(_PROGRAMS) >= 2:  # a process calibrates one model at a time
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        cached = _PROGRAMS[source.key] = build_calibration_program(source, family, spec)
    return cached


def open_weights(source: ProgramSource) -> WeightStore:
    """The checkpoint's weights as the program names them (the family's weight mapping applied), opened by path
    (a worker that reads the float model itself)."""
    from topq.core.pipeline import open_checkpoint
    from topq.core.plugins import get_plugins

    plugins = get_plugins()
    store = open_checkpoint(plugins, source.checkpoint, source.format).weights
    return plugins.families.get(source.family).weights(ModelSpec.from_dict(source.spec), store)
