"""Perplexity of SmolLM2-135M-Instruct on the bm1684x emulator (W8BF16, W4BF16 g64) vs the host in float32.

    cd /work/main && python -m benchmarks.emulator_quality                     # temp dir, 4 windows of 512
    cd /work/main && python -m benchmarks.emulator_quality --dir out/bench --json

The text is the first `--windows` × 512 tokens of Persuasion (Austen), scored in independent windows of 512 with
`topq.core.runtime.perplexity` (each window: one prefill + three prefill_kv segments of 128, then the lm_head on
every position). The check: W8BF16 within 1 % of the float32 host (exit status 1 otherwise); W4BF16 is reported.
Too slow for CI (minutes on a small machine): a benchmark, not a test.
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

ROOT = Path(__file__).resolve().parents[1]
TEXT = Path("/work/shared/data/austen/03_Persuasion.txt")
WINDOW = 512


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, help="where bundles are written / reused (default: a temp dir)")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--windows", type=int, default=4, help="windows of 512 tokens (default 4)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    from benchmarks.emulator_decode import bundle_for
    from topq.core.bundle import Bundle
    from topq.core.runtime import perplexity

    directory = args.dir or Path(tempfile.mkdtemp(prefix="topq-emu-"))
    directory.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}
    ids: list[int] = []
    for chip, scheme in (("host", "f32"), ("bm1684x", "w8bf16"), ("bm1684x", "w4bf16")):
        bundle = Bundle(bundle_for(directory, chip, scheme))
        if not ids:
            ids = bundle.tokenizer.encode(args.text.read_text(encoding="utf-8"))[:args.windows * WINDOW]
        started = time.perf_counter()
        ppl, count = perplexity(bundle, ids, window=WINDOW)
        rows[f"{chip}_{scheme}"] = {"perplexity": round(ppl, 4), "tokens": count,
                                    "seconds": round(time.perf_counter() - started, 1)}
    base = rows["host_f32"]["perplexity"]
    for row in rows.values():
        row["vs_host_f32"] = f"{(row['perplexity'] / base - 1) * 100:+.2f} %"
    ok = abs(rows["bm1684x_w8bf16"]["perplexity"] / base - 1) <= 0.01
    result = {"text": args.text.name, "windows": args.windows, "window": WINDOW, "rows": rows,
              "w8bf16_within_1_percent": ok}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.text.name}: {len(ids)} tokens in windows of {WINDOW}")
        for key, row in rows.items():
            print(f"  {key:<16} ppl {row['perplexity']:>9.4f}  {row['vs_host_f32']:>9}  ({row['seconds']} s)")
        print(f"  W8BF16 within 1 % of host f32: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
