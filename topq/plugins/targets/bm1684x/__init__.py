"""The BM1684X-family target: `bm1684x` and `bm1688` are two ChipSpecs of the same code.

compile: Top → tpu lowering (lowering.py), layer groups (layer_group.py), DDR plan (memory.py), program text +
packed tensors (compiler.py, packing.py). open: the emulator (emulator.py) on a simulated DDR with the chip's
numerics (kernels.py). perf: the performance model (perf.py). See docs/bm1684x.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import topq
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.hookspecs import Register
from topq.core.target import Target
from topq.plugins.targets.bm1684x.compiler import PROGRAM_VERSION, compile_model
from topq.plugins.targets.bm1684x.emulator import Emulator, checker_requested
from topq.plugins.targets.bm1684x.memory import human
from topq.plugins.targets.bm1684x.modes import FLOAT_DTYPES, refuses
from topq.plugins.targets.bm1684x.perf import bundle_estimates, perf_entry
from topq.plugins.targets.bm1684x.spec import SPECS, ChipSpec


@dataclass(frozen=True)
class ChipTarget(Target):
    """A Target that knows its chip spec."""

    chip: ChipSpec | None = None


def open_bundle(bundle: Bundle, chip: ChipSpec, checker: bool | None = None, kv_sync: str | None = None) -> Emulator:
    """The emulator for a bundle compiled for `chip` (checker: None = from TOPQ_CHECKER or the recipe)."""
    meta = bundle.meta.get("target_meta") or {}
    compiled_for = meta.get("chip") or bundle.target
    if bundle.target != chip.name or compiled_for != chip.name:
        raise TopqError(f"{bundle.path}: bundle was compiled for {compiled_for}, not {chip.name}; "
                        f"convert it again with target.chip={chip.name}")
    if meta.get("program_version") != PROGRAM_VERSION:
        raise TopqError(f"{bundle.path}: {chip.name} program version {meta.get('program_version')} is not the "
                        f"emulator's {PROGRAM_VERSION}; convert it again")
    if meta.get("dtype") not in FLOAT_DTYPES:
        raise TopqError(f"{bundle.path}: mode {meta.get('mode')!r} computes in {meta.get('dtype')!r}, which the "
                        f"{chip.name} emulator cannot run; it runs: {', '.join(FLOAT_DTYPES)}")
    if checker is None:
        checker = checker_requested(bundle.recipe)
    return Emulator(bundle.program, bundle.tensor, chip, checker=checker,
                    kv_sync=kv_sync or os.environ.get("TOPQ_BM_KV_SYNC", "incremental"))


def report(bundle: Bundle, chip: ChipSpec) -> dict[str, Any]:
    """Memory map, layer-group summary and (when the performance model loads) the predicted speed."""
    meta = bundle.meta.get("target_meta") or {}
    memory = meta.get("memory", {})
    groups = meta.get("layer_groups", {})
    tiled = {f"{fn}:{op}": t for fn, r in groups.items() for op, t in r.get("tiled", {}).items()}
    lines = [f"{chip.name} DDR plan ({meta.get('mode')}): {human(memory.get('total', 0))} of {human(chip.ddr_size)}"]
    for region in ("coeff", "kv", "state", "act"):
        if region in memory:
            base, size = memory[region]
            lines.append(f"  {region:<6} 0x{base:010x}  {human(size)}")
        if region == "state":
            lines += _state_lines(memory, (bundle.meta.get("stages") or {}).get("layer_states") or [])
    lines.append(f"layer groups: {sum(r['groups'] for r in groups.values())} in {len(groups)} functions; "
                 f"peak local memory {max((r['peak_lmem_per_lane'] for r in groups.values()), default=0)} B/lane "
                 f"of {chip.local_mem_per_lane}; {len(tiled)} tiled ops")
    out: dict[str, Any] = {"memory": memory, "layer_groups": groups, "text_sections": ["\n".join(lines)]}
    try:
        predicted = out["predicted"] = _perf(chip)(bundle=bundle)
        # The per-op view of one layer's prefill and full-length decode, and the head.
        estimates = bundle_estimates(bundle, chip, ("block_0", "block_cache_0", "lm_head"))
    except (TopqError, KeyError, ValueError) as exc:  # optional for inspect; say why it is missing
        out["predicted_error"] = str(exc)
        return out
    out["predicted_ops"] = {e.name: [dataclasses.asdict(r) for r in e.rows] for e in estimates}
    out["text_sections"].append(
        f"predicted ({chip.name} performance model): first token {predicted['ftl_s'] * 1e3:.1f} ms, "
        f"decode {predicted['decode_tps']:.1f} tokens/s, {predicted['bytes_per_token'] / 1e6:.1f} MB/token\n\n"
        + "\n\n".join(e.table() for e in estimates))
    return out


def _state_lines(memory: dict[str, Any], carried: list[list[Any]]) -> list[str]:
    """One line per recurrent layer: its fixed f32 state regions, by the names the bundle's stages give them."""
    lines = []
    for entry in memory.get("state_layers", []):
        names = [name for name, _ in carried[entry["layer"]]] if entry["layer"] < len(carried) else []
        states = ", ".join(f"{names[i] if i < len(names) else i} {'x'.join(map(str, st['shape']))} "
                           f"@0x{st['addr']:x}" for i, st in enumerate(entry["states"]))
        lines.append(f"    layer {entry['layer']:<3} {human(entry['bytes'])}: {states}")
    return lines


def _perf(chip: ChipSpec) -> Callable[..., dict[str, Any]]:
    return perf_entry(chip)


def make_target(chip: ChipSpec) -> ChipTarget:
    return ChipTarget(
        name=chip.name,
        description=f"{chip.name} emulator: {chip.lanes} lanes x {chip.cores} core(s), bf16/f16 storage, "
                    f"f32 accumulation, W4/W8 weight-only",
        compile=functools.partial(compile_model, chip=chip),
        open=functools.partial(open_bundle, chip=chip),
        refuses=refuses,
        perf=_perf(chip),
        chip=chip,
        report=functools.partial(report, chip=chip),
    )


TARGETS = tuple(make_target(SPECS[name]) for name in ("bm1684x", "bm1688"))


@topq.hookimpl
def register_targets(register: Register[Target]) -> None:
    for target in TARGETS:
        register(target)
