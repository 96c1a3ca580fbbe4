"""The calibration layer loop's products on this CPU: numpy (the reference path) next to torch f32 and bf16.

    python -m benchmarks.calibration_kernels [--threads 1] [--repeats 10]

Shapes are SmolLM2-135M's at a 512-token calibration window: the forwards' linears (x Wᵀ), the Hessian Gram sums
(xᵀx of one operand, as `InputStats` computes them: numpy hands that to BLAS `syrk`, half a product's
multiply-adds), and the [N, K] · H products of the error report and AWQ's searches. Each row is the median of
`--repeats` timed calls after one warm-up, all in this process, with the numpy / torch thread counts set to
`--threads`. This decides whether a torch backend for calibration-time linear algebra pays here (issue 17): it
would have to be faster than numpy's BLAS on these shapes. The "topq bf16" column is what the layer loop runs
inside `products("bf16")` (`topq.ir.products`): float32 operands rounded to bf16 and the result widened back, and
for a Gram `gram_upper`'s strips of its upper triangle (torch's "torch bf16" column is a whole product of bf16
tensors).

The last lines are GPTQ's floor on this CPU: the products a calibrated layer cannot do without (each of its seven
linears once per sample, with the quantized weights, and the Grams of its four inputs), for SmolLM2's 30 layers and
128 samples, on two threads at the measured numpy rates — the row's seconds cannot go below it in float32 — and at
topq's bf16 rates.
"""

from __future__ import annotations

import argparse
import operator
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (what, is a Gram, M, K, N, per GPTQ layer and sample): an [M, K] · [K, N] product; a Gram (M = N) is xᵀx of one
#: x [K, M]
SHAPES = [
    ("linear q/o (x Wᵀ)", False, 512, 576, 576, 2),
    ("linear k/v", False, 512, 576, 192, 2),
    ("linear gate/up", False, 512, 576, 1536, 2),
    ("linear down", False, 512, 1536, 576, 1),
    ("Gram xᵀx, K = 576", True, 576, 512, 576, 3),  # q/k/v's, o's and gate/up's inputs
    ("Gram xᵀx, K = 1536", True, 1536, 512, 1536, 1),  # down's
    ("report / AWQ: D H, gate/up", False, 3072, 576, 576, 0),
    ("report / AWQ: D H, down", False, 576, 1536, 1536, 0),
]
LAYERS, SAMPLES, JOBS = 30, 128, 2  # quant_speed's setting


def gram(x: Any, _: Any) -> object:
    return x.T @ x


def median_ms(product: Callable[[Any, Any], object], a: Any, b: Any, repeats: int) -> float:
    product(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f" {f}" in flags) or "none of " + ", ".join(wanted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)

    import numpy as np
    import torch
    from threadpoolctl import threadpool_limits

    from topq.ir.products import gram_upper, matmul, products
    from topq.ir.threads import kernel_info, kernel_name

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    rows = []
    floor_ms = bf16_floor_ms = 0.0  # GPTQ's products per layer and sample, numpy f32 and topq bf16
    with threadpool_limits(args.threads), products("bf16"):  # `products` decides only the topq column's
        for what, is_gram, m, k, n, per_layer in SHAPES:
            a = rng.standard_normal((k, m) if is_gram else (m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            product = gram if is_gram else operator.matmul
            numpy_ms = median_ms(product, a, b, args.repeats)
            torch_ms = median_ms(product, ta, tb, args.repeats)
            bf16_ms = median_ms(product, ta.bfloat16(), tb.bfloat16(), args.repeats)
            topq_ms = median_ms((lambda x, _: gram_upper(x)) if is_gram else matmul, a, b, args.repeats)
            multiply_adds = m * (m + 1) / 2 * k if is_gram else m * k * n  # syrk computes one triangle
            rows.append((what, f"[{m}, {k}] · [{k}, {n}]", numpy_ms, 2 * multiply_adds / numpy_ms / 1e6, torch_ms,
                         bf16_ms, topq_ms))
            floor_ms += per_layer * numpy_ms
            bf16_floor_ms += per_layer * topq_ms
    for info in kernel_info():
        print(f"kernel: {kernel_name(info)}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}")
    print(f"{args.threads} thread(s); load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"| {'product':<28} | {'shape':<26} | numpy f32 ms | numpy GFLOPS | torch f32 ms | torch bf16 ms "
          "| topq bf16 ms | torch f32 / numpy |")
    print(f"|{'-' * 30}|{'-' * 28}|-------------:|-------------:|-------------:|--------------:|-------------:"
          "|------------------:|")
    for what, shape, numpy_ms, gflops, torch_ms, bf16_ms, topq_ms in rows:
        print(f"| {what:<28} | {shape:<26} | {numpy_ms:12.2f} | {gflops:12.1f} | {torch_ms:12.2f} | "
              f"{bf16_ms:13.2f} | {topq_ms:12.2f} | {torch_ms / numpy_ms:17.2f} |")
    for kind, ms in (("numpy f32", floor_ms), ("topq bf16", bf16_floor_ms)):
        print(f"GPTQ's products per layer and 512-token sample (7 linears, 4 Grams), {kind}: {ms:.1f} ms; "
              f"× {SAMPLES} samples × {LAYERS} layers on {JOBS} threads: {ms * SAMPLES * LAYERS / JOBS / 1e3:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
