"""The spill: quantized values leave the process's memory for maps of an unlinked file (the layer loop's finished
layers, int8's search), the same bits; released pages leave it again until read."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from topq.core.quant import QuantizedWeight
from topq.quant.calibration import LayerState, run_calibration
from topq.quant.grid import rtn
from topq.quant.spill import Spill, mapping_of


def test_moved_arrays_keep_their_bits_are_read_only_and_leave_no_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    first = [rng.integers(0, 16, (96, 130), dtype=np.uint8), rng.standard_normal((96, 3), dtype=np.float32),
             rng.integers(-8, 8, (7,), dtype=np.int8), np.zeros((0, 4), np.float32),
             rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16), rng.integers(0, 3, 130).astype(np.int32)]
    second = [rng.standard_normal((33, 17), dtype=np.float32)[:, ::2]]  # not contiguous
    spill = Spill(tmp_path)
    moved = spill.move(first) + spill.move(second)
    spill.close()  # the maps outlive the file object
    for array, view in zip(first + second, moved):
        assert view.dtype == array.dtype and view.shape == array.shape
        assert np.array_equal(np.ascontiguousarray(array).view(np.uint8), np.ascontiguousarray(view).view(np.uint8))
        if view.size:
            assert isinstance(mapping_of(view), mmap.mmap)
            with pytest.raises(ValueError, match="read-only"):
                view[(0,) * view.ndim] = 0
    assert os.listdir(tmp_path) == []  # unlinked from the start: nothing to clean up, even after a crash
    assert Spill(tmp_path).move([np.zeros(0, np.uint8)])[0].size == 0  # nothing to map: no map, no file


#: 64 MiB of codes, resident, then moved to the spill: the process's RSS before, after the move, after reading them
RESIDENT = """
import json, re, sys
import numpy as np
from topq.quant.spill import Spill, mapping_of, release
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) >> 10
codes = np.arange(64 << 20, dtype=np.uint64).astype(np.uint8)
before = rss()
[moved] = Spill(sys.argv[1]).move([codes])
del codes
after = rss()
total = int(moved.sum(dtype=np.uint64))
read = rss()
release([moved[:1]])  # any view of the map releases all of it
released = rss()
again = int(moved.sum(dtype=np.uint64))
print(json.dumps({"before": before, "after": after, "read": read, "released": released, "total": total,
                  "again": again}))
"""


def test_moved_values_leave_the_processs_resident_memory_until_read(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", RESIDENT, str(tmp_path)], capture_output=True, text=True, check=True)
    mib = json.loads(out.stdout)
    assert mib["total"] == (64 << 20) // 256 * sum(range(256))
    assert mib["before"] - mib["after"] > 56  # the 64 MiB went to the page cache
    assert mib["read"] - mib["after"] > 56  # and come back as the file's pages when read
    assert mib["read"] - mib["released"] > 56 and mib["again"] == mib["total"]  # released: the same values again


def test_the_layer_loop_moves_each_finished_layer_to_the_spill(loaded_tiny: Any, tmp_path: Path) -> None:
    """The values are the solver's bits; each layer's go to the spill when the layer ends (the next layer's solver
    already sees the earlier ones mapped), and the spill directory stays empty."""
    model = loaded_tiny("llama", 16)
    published: dict[str, QuantizedWeight] = {}
    mapped_before: list[tuple[int, bool, bool]] = []

    def solve(group: Any, state: LayerState, options: Any) -> None:
        earlier = [qw for name, qw in state.result.items() if f".layers.{group.layer}." not in name]
        mine = [qw for name, qw in state.result.items() if f".layers.{group.layer}." in name]
        mapped_before.append((group.layer, all(isinstance(mapping_of(qw.codes), mmap.mmap) for qw in earlier),
                              any(isinstance(mapping_of(qw.codes), mmap.mmap) for qw in mine)))
        stacked = rtn(np.concatenate([state.float_weight(n) for n in group.names]), 4, 32, False)
        state.set_quantized_rows(group.names, stacked)
        for name in group.names:  # copies: what the solver published, wherever the loop then keeps it
            qw = state.result[name]
            published[name] = QuantizedWeight(qw.codes.copy(), qw.scales.copy(), qw.zeros.copy(), qw.bits,
                                              qw.group_size, qw.symmetric)

    ids = np.random.default_rng(1).integers(0, model.spec.vocab_size, (3, 16), dtype=np.int32)
    result = run_calibration(model, ids, solve, {"group_size": 32}, progress=False, spill_dir=tmp_path)
    assert set(result) == set(published) and len(result) == 7 * model.spec.num_layers
    assert all(earlier and not mine for _, earlier, mine in mapped_before)
    assert {layer for layer, _, _ in mapped_before} == set(range(model.spec.num_layers))
    for name, qw in result.items():
        expected = published[name]
        for got, want in ((qw.codes, expected.codes), (qw.scales, expected.scales), (qw.zeros, expected.zeros)):
            assert isinstance(mapping_of(got), mmap.mmap) and not got.flags.writeable
            assert got.dtype == want.dtype and np.array_equal(got, want)
    assert os.listdir(tmp_path) == []
