"""Quantized values out of the process's memory: the calibration's memory stays one layer's, not the model's.

The calibration layer loop produces every linear's codes, scales and zero points layer by layer, and the pipeline
reads them only after the last layer, to pack the bundle. Held in memory they grow with the model (SmolLM2-135M's
codes alone are 101 MiB; a 7B model's are 6.5 GiB) while the loop's working set is one layer's. So at the end of
each layer the loop writes that layer's arrays to one temporary file and keeps read-only maps of them instead
(`Spill.move`): the pages go to the kernel's page cache, which can write them out, and count in the process's
resident memory only once something reads them — the bundle's packing, after the loop freed its activations.

The file is created beside the output (a conversion's output directory is known writable and has to hold the
bundle anyway; elsewhere the temporary directory) and unlinked at once: nothing is left behind, even when the
process dies, and the maps keep its contents for as long as any array needs them. One map per layer, not per
array: a process has a limited number of maps (65,530 by default on Linux), and an MoE model has
thousands of linears. The values are the same bits; only where they live changes.

int8's mixed-precision search reads every layer's values again in each of its evaluations. It keeps them (and
each linear's bf16 form) in a spill too, and `release`s a layer's pages after running the layer, so they leave the
process's resident memory until the next evaluation maps them again from the page cache (cheap: a minor fault per
64 KiB; dropping and faulting in 180 MiB of maps cost nothing measurable beside summing them once, in a one-off
script).
"""

from __future__ import annotations

import dataclasses
import mmap
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from topq.core.quant import QuantizedWeight

__all__ = ["Spill", "mapping_of", "move_quantized", "release", "spill_directory"]

#: each array's offset in its layer's map (any dtype's alignment, and a cache line)
ALIGN = 64


class Spill:
    """An unlinked temporary file of arrays, read back through read-only maps (see the module doc)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self._directory = directory
        self._file: IO[bytes] | None = None  # created at the first move
        self._size = 0  # where the next map starts (a multiple of mmap.ALLOCATIONGRANULARITY)

    def move(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The values of `arrays` as read-only arrays of the file, all in one map; the caller drops its own."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            start = -(-end // ALIGN) * ALIGN
            offsets.append(start)
            end = start + a.nbytes
        if end == 0:  # nothing to map (mmap refuses a zero length)
            return arrays
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="topq-spill-", dir=self._directory)
        file = self._file
        for a, offset in zip(arrays, offsets):
            file.seek(self._size + offset)
            file.write(a.reshape(-1).view(np.uint8).data)
        file.flush()
        mapped = mmap.mmap(file.fileno(), end, access=mmap.ACCESS_READ, offset=self._size)
        self._size += -(-end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        return [np.frombuffer(mapped, a.dtype, a.size, offset).reshape(a.shape) for a, offset in zip(arrays, offsets)]

    def close(self) -> None:
        """Close the file; the maps made so far stay valid (each holds the file open while an array uses it)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def move_quantized(spill: Spill, values: Mapping[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """`values` with their arrays (codes, scales, zeros, g_idx) moved to `spill`, all in one map."""
    arrays = iter(spill.move([a for qw in values.values() for a in _arrays_of(qw)]))
    return {name: dataclasses.replace(qw, codes=next(arrays), scales=next(arrays), zeros=next(arrays),
                                      g_idx=next(arrays) if qw.g_idx is not None else None)
            for name, qw in values.items()}


def _arrays_of(qw: QuantizedWeight) -> list[np.ndarray]:
    return [qw.codes, qw.scales, qw.zeros] + ([qw.g_idx] if qw.g_idx is not None else [])


def mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The spill map an array (or a view of one) lives in; None for an array of the process's own memory."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def release(arrays: Iterable[np.ndarray]) -> None:
    """Take the pages of the maps these spilled arrays live in out of the process's resident memory, for a loop
    that reads a layer's values again and again (int8's search): the page cache keeps them, and the next read maps
    them again (a minor fault per 64 KiB; no disk read unless the kernel wrote them out meanwhile). The values do
    not change. Arrays of the process's own memory are left alone."""
    seen: set[int] = set()
    for array in arrays:
        mapped = mapping_of(array)
        if mapped is not None and id(mapped) not in seen and hasattr(mapped, "madvise"):
            seen.add(id(mapped))
            mapped.madvise(mmap.MADV_DONTNEED)


def spill_directory(output: str | Path) -> Path | None:
    """Where a conversion spills: beside its output once that directory exists (the pipeline checks it is
    writable before any work), else None (the temporary directory)."""
    directory = Path(output).parent
    return directory if directory.is_dir() else None
