"""Perplexity of SmolLM2-135M W4 g64 asymmetric on the onnx target (each MatMulNBits accuracy level) vs the host.

The same windows as `topq eval --window 512`: the first `--windows` × 512 tokens of Persuasion, each window
independent. Measured 2026-12-01 (4 windows, 2044 predicted tokens): host 48.8856, onnx accuracy_level 0 48.8856
(0.0 %), accuracy_level 4 49.0689 (+0.375 %).

    python -m benchmarks.onnx_quality                     # 4 windows, levels 0 and 4
    python -m benchmarks.onnx_quality --levels 0 1 4 --bundles out/ --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WINDOW = 512
AUSTEN = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "austen"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=4, help="512-token windows to evaluate (default 4)")
    p.add_argument("--levels", type=int, nargs="+", default=[0, 4], choices=range(5), help="accuracy levels")
    p.add_argument("--text", type=Path, default=AUSTEN / "03_Persuasion.txt", help="evaluation text")
    p.add_argument("--threads", type=int, default=2, help="threads of both targets (default 2)")
    p.add_argument("--bundles", type=Path, help="directory for the converted bundles (reused when present)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def convert_bundle(directory: Path, chip: str) -> Path:
    from benchmarks.host_decode import gguf_path
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    output = directory / f"smollm2-w4g64-{chip}-eval.topq"
    if not output.exists():
        recipe = recipe_from_defaults(
            model={"path": str(gguf_path())}, quant={"scheme": "w4bf16", "group_size": 64, "symmetric": False},
            target={"chip": chip}, output={"path": str(output)},
            stages={"seq_length": WINDOW, "max_input_length": WINDOW, "decode_chunks": []})
        convert(recipe, progress=False)
    return output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["TOPQ_ONNX_THREADS"] = str(args.threads)
    from topq.core.bundle import Bundle
    from topq.core.runtime import perplexity
    from topq.plugins.targets.onnx.executor import OnnxExecutor

    text = args.text.read_text(encoding="utf-8")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="topq-bench-") as tmp:
        directory = args.bundles or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        host = Bundle(convert_bundle(directory, "host"))
        onnx_bundle = Bundle(convert_bundle(directory, "onnx"))
        ids = host.tokenizer.encode(text)[:args.windows * WINDOW]
        runs: list[tuple[str, Bundle, Any]] = [("host", host, None)]
        runs += [(f"onnx accuracy_level {level}", onnx_bundle, OnnxExecutor(onnx_bundle, accuracy_level=level))
                 for level in args.levels]
        for name, bundle, executor in runs:
            started = time.perf_counter()
            ppl, count = perplexity(bundle, ids, window=WINDOW, executor=executor)
            rows.append({"backend": name, "perplexity": round(ppl, 4), "tokens": count,
                         "seconds": round(time.perf_counter() - started, 1)})
    base = rows[0]["perplexity"]
    for row in rows:
        row["vs_host_percent"] = round((row["perplexity"] / base - 1) * 100, 3)
    if args.json:
        print(json.dumps({"model": "SmolLM2-135M-Instruct W4 g64 asym", "text": args.text.name, "rows": rows}))
        return 0
    print(f"SmolLM2-135M-Instruct W4 g64 asym, {args.text.name}, {args.windows} × {WINDOW}-token windows")
    print(f"{'backend':<26} {'perplexity':>11} {'vs host':>9} {'tokens':>7} {'seconds':>8}")
    for row in rows:
        print(f"{row['backend']:<26} {row['perplexity']:>11} {row['vs_host_percent']:>8}% {row['tokens']:>7} "
              f"{row['seconds']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
