"""The cube's matmul rate per core as TPU-MLIR's own cycle model times it, next to topq's chip specs.

    python -m benchmarks.cube_rate [--tpu-mlir PYTHON] [--shape M,K,N ...] [--mode BF16 ...] [--json]

Each row compiles one `[1, M, K] x [K, N]` `top.MatMul` with `model_deploy.py --debug` for a chip, a core count
and a quantize mode, and reads the TIU cycles of its matrix-multiply instructions (MM2; MM or CONV for f32)
from the compiler's profile (`compiler_profile_0.txt`, core 0). MACs per cycle and core = M·K·N / cores / those
cycles; `spec.py`'s is `peak_ops[dtype] / (2 × clock_hz)`, the rate the perf model assumes (it applies
`cube_eff` on top). The total is the compiler's whole-net estimate (TIU and GDMA overlapped). TPU-MLIR comes
from `--tpu-mlir` or $TOPQ_TPU_MLIR (scripts/setup-tpu-mlir.sh makes one); about 4 s per row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from topq.plugins.exporters.tpu_mlir.deploy import TpuMlir, find_tpu_mlir, run_tool  # noqa: E402  (after sys.path)
from topq.plugins.targets.bm1684x.spec import SPECS  # noqa: E402  (after the sys.path line above)

#: (chip, cores, model_deploy --quantize, the spec.py dtype whose peak it uses)
CASES = (
    ("bm1684x", 1, "BF16", "bf16"),
    ("bm1684x", 1, "W4BF16", "bf16"),
    ("bm1684x", 1, "F32", "f32"),
    ("bm1688", 2, "BF16", "bf16"),
    ("bm1688", 2, "F16", "f16"),
    ("bm1688", 2, "W4BF16", "bf16"),
    ("bm1688", 2, "INT8", "int8"),
    ("bm1688", 2, "F32", "f32"),
)
DEFAULT_SHAPES = ((512, 2560, 2560),)
CYCLES = re.compile(r"\|t:(\d+)")
TOTAL = re.compile(r"TCYC : (\d+)")
MATMUL_INSTRUCTIONS = frozenset({"MM2", "MM", "CONV"})  # f32 matmuls are lowered to MM/CONV, 16/8-bit ones to MM2


def matmul_net(directory: Path, m: int, k: int, n: int) -> str:
    """Write a one-MatMul Top module and its weights into `directory`; return the module's file name."""
    name = f"mm_{m}_{k}_{n}"
    weight = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float32)
    np.savez(directory / f"{name}_top_weights.npz", w=weight)

    def f32(*shape: int) -> str:
        return "tensor<" + "x".join(map(str, shape)) + "xf32>"

    x, w, y = f32(1, m, k), f32(k, n), f32(1, m, n)
    (directory / f"{name}.mlir").write_text("\n".join([
        (f'module @"{name}" attributes {{module.chip = "ALL", module.platform = "ONNX", module.state = "TOP_F32", '
         f'module.top_run_mode = "STATIC", module.weight_file = "{name}_top_weights.npz"}} {{'),
        f"  func.func @main(%arg0: {x} loc(unknown)) -> {y} {{",
        '    %0 = "top.None"() : () -> none loc(unknown)',
        f'    %1 = "top.Input"(%arg0) : ({x}) -> {x} loc("x")',
        f'    %2 = "top.Weight"() : () -> {w} loc("w")',
        f'    %3 = "top.MatMul"(%1, %2, %0) : ({x}, {w}, none) -> {y} loc("y")',
        f"    return %3 : {y} loc(unknown)",
        "  } loc(unknown)",
        "} loc(unknown)",
        "",
    ]), encoding="utf-8")
    # INT8 needs thresholds: |x| and |y| within 4 (the values do not change the cycle count)
    (directory / "cali_table").write_text("# op_name threshold min max\nx 4.0 -4.0 4.0\ny 4.0 -4.0 4.0\n",
                                          encoding="utf-8")
    return name


def profile_cycles(profile: Path) -> tuple[int, int]:
    """(TIU cycles of the matrix-multiply instructions, the net's total cycles) of one core's compiler profile."""
    mm2 = total = 0
    for line in profile.read_text(encoding="utf-8", errors="replace").splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1] in MATMUL_INSTRUCTIONS and (found := CYCLES.search(line)):
            mm2 += int(found.group(1))
        elif found := TOTAL.search(line):
            total = int(found.group(1))
    return mm2, total


def measure(tpu: TpuMlir, chip: str, cores: int, quantize: str, dtype: str, shape: tuple[int, int, int],
            work: Path) -> dict[str, Any]:
    m, k, n = shape
    directory = work / f"{chip}_{cores}_{quantize}_{m}_{k}_{n}"
    directory.mkdir(parents=True)
    name = matmul_net(directory, m, k, n)
    args = ["--mlir", f"{name}.mlir", "--chip", chip, "--quantize", quantize, "--num_core", str(cores),
            "--model", f"{name}.bmodel", "--debug"]
    args += ["--calibration_table", "cali_table"] if quantize == "INT8" else ["--quant_input", "--quant_output"]
    args += ["--q_group_size", "64"] if quantize.startswith("W") else []
    run_tool(tpu, "model_deploy.py", args, directory, "deploy.log")
    mm2, total = profile_cycles(directory / "compiler_profile_0.txt")
    spec = SPECS[chip]
    macs_per_core = m * k * n / cores
    return {
        "chip": chip, "cores": cores, "quantize": quantize, "shape": [m, k, n],
        "mm2_cycles_per_core": mm2, "macs_per_cycle": macs_per_core / mm2 if mm2 else None,
        "spec_macs_per_cycle": spec.peak_ops[dtype] / (2 * spec.clock_hz),
        "total_cycles": total, "total_ms": total / spec.clock_hz * 1e3,
        "achieved_tflops": 2 * m * k * n / (total / spec.clock_hz) / 1e12 if total else None,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["Matmul rate per core: TPU-MLIR's cycle model (model_deploy.py --debug, matmul instructions of core 0) "
           "vs topq's spec.py", "",
           f"{'chip':<9}{'cores':>6}{'mode':>8}{'M x K x N':>20}{'MM cycles':>12}{'MAC/cycle':>11}"
           f"{'spec.py':>9}{'total ms':>10}{'TFLOPS':>8}"]
    for r in rows:
        rate = f"{r['macs_per_cycle']:.0f}" if r["macs_per_cycle"] else "-"
        tflops = f"{r['achieved_tflops']:.2f}" if r["achieved_tflops"] else "-"
        out.append(f"{r['chip']:<9}{r['cores']:>6}{r['quantize']:>8}{' x '.join(map(str, r['shape'])):>20}"
                   f"{r['mm2_cycles_per_core']:>12}{rate:>11}{r['spec_macs_per_cycle']:>9.0f}"
                   f"{r['total_ms']:>10.3f}{tflops:>8}")
    out += ["", "W4BF16 rows: the matmul runs at the bf16 rate; the dequantisation adds EU cycles (in the total)."]
    return "\n".join(out)


def parse_shape(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.split(","))
    return m, k, n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tpu-mlir", help="the TPU-MLIR venv's python (default $TOPQ_TPU_MLIR)")
    parser.add_argument("--shape", action="append", type=parse_shape, help="M,K,N (repeatable)")
    parser.add_argument("--mode", action="append", choices=sorted({c[2] for c in CASES}),
                        help="only the rows of this quantize mode (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    tpu = find_tpu_mlir(args.tpu_mlir)
    if tpu is None:
        parser.error("TPU-MLIR not found: pass --tpu-mlir PYTHON or set TOPQ_TPU_MLIR (scripts/setup-tpu-mlir.sh)")
    with tempfile.TemporaryDirectory(prefix="cube_rate_") as work:
        rows = [measure(tpu, chip, cores, quantize, dtype, shape, Path(work))
                for shape in (args.shape or DEFAULT_SHAPES) for chip, cores, quantize, dtype in CASES
                if not args.mode or quantize in args.mode]
    print(json.dumps({"rows": rows}) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
