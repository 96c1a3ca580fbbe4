"""With TPU-MLIR installed: the cube rates in spec.py are the ones TPU-MLIR's own cycle model gives its matmuls
(benchmarks/cube_rate.py; docs/perf.md, "The cube's rate from TPU-MLIR's cycle model"). About 8 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tpu_mlir_nets import tpu_mlir_installation

REPO = Path(__file__).resolve().parents[3]


def test_spec_cube_rates_are_tpu_mlirs() -> None:
    tpu = tpu_mlir_installation()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.cube_rate", "--tpu-mlir", str(tpu.python),
                           "--shape", "256,1024,1024", "--mode", "BF16", "--mode", "INT8", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["chip"], r["quantize"]): r for r in json.loads(done.stdout)["rows"]}
    assert set(rows) == {("bm1684x", "BF16"), ("bm1688", "BF16"), ("bm1688", "INT8")}
    for row in rows.values():
        assert row["macs_per_cycle"] == pytest.approx(row["spec_macs_per_cycle"], rel=0.01), row
    # BM1688's 16-bit cube is a quarter of its int8 one (BM1684X's is half: 32.8 / 16.4 TOPS)
    assert rows["bm1688", "INT8"]["macs_per_cycle"] == pytest.approx(4 * rows["bm1688", "BF16"]["macs_per_cycle"])
