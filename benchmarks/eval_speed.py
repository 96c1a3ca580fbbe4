"""`topq eval`'s perplexity with lm_head batched over a segment's positions vs one lm_head call per position, on
SmolLM2-135M-Instruct (host float32 and the bm1684x emulator W4BF16), in one process.

    cd /work/main && python -m benchmarks.eval_speed --dir /tmp/bench                      # 1 window of 512
    cd /work/main && python -m benchmarks.eval_speed --dir /tmp/bench --windows 2 --json

Both rows of a runtime evaluate the same tokens (the first `--windows` x 512 tokens of `--text`, tokenized by the
bundle) with `topq.core.runtime.perplexity`; `per-position` turns the executor's `lm_head_rows` off, which is the
runtime's path before batching. The wall time of the lm_head calls is timed on its own (the part batching changes;
the prefill segments around it take the same time in both rows, up to the machine's load). Bundles are converted
into `--dir` once (the decode benchmarks' settings: seq_length 512, max_input_length 128), so a window is one prefill
and three prefill-with-history segments. The table prints seconds (whole eval and lm_head calls), the batched
speed-ups and the relative perplexity difference; the kernel line says which BLAS ran.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.emulator_decode import bundle_for  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "austen" / "03_Persuasion.txt"
WINDOW = 512


class TimedHead:
    """An executor that adds up the wall time of its lm_head calls (the part batching changes)."""

    def __init__(self, executor: Any, batched: bool) -> None:
        self.executor, self.head_s, self.head_calls = executor, 0.0, 0
        self.lm_head_rows = batched and getattr(executor, "lm_head_rows", False)

    def run(self, name: str, inputs: list[Any]) -> list[Any]:
        if name != "lm_head":
            return self.executor.run(name, inputs)
        started = time.perf_counter()
        out = self.executor.run(name, inputs)
        self.head_s += time.perf_counter() - started
        self.head_calls += 1
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, help="where bundles are written / reused (default: a temp dir)")
    p.add_argument("--text", type=Path, default=TEXT, help=f"evaluation text (default {TEXT})")
    p.add_argument("--windows", type=int, default=1, help="512-token windows to evaluate (default 1)")
    p.add_argument("--skip-emulator", action="store_true", help="time only the host runtime")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.windows < 1:
        p.error("--windows must be at least 1")
    if not args.text.is_file():
        p.error(f"{args.text}: no such text file")

    from topq.core.bundle import Bundle
    from topq.core.runtime import open_executor, perplexity
    from topq.ir.threads import kernel_info, kernel_name, max_threads

    directory = args.dir or Path(tempfile.mkdtemp(prefix="topq-eval-"))
    directory.mkdir(parents=True, exist_ok=True)
    bundles = {"topq host f32": Bundle(bundle_for(directory, "host", "f32"))}
    if not args.skip_emulator:
        bundles["topq emulator w4bf16"] = Bundle(bundle_for(directory, "bm1684x", "w4bf16"))
    ids = bundles["topq host f32"].tokenizer.encode(args.text.read_text(encoding="utf-8"))[:args.windows * WINDOW + 1]
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    for name, bundle in bundles.items():
        results = {}
        for setting in ("per-position", "batched"):
            executor = TimedHead(open_executor(bundle), batched=setting == "batched")
            started = time.perf_counter()
            ppl, count = perplexity(bundle, ids, window=WINDOW, executor=executor)
            results[setting] = (time.perf_counter() - started, executor.head_s, executor.head_calls, ppl)
        (slow, slow_head, _, ref), (fast, fast_head, _, ppl) = results["per-position"], results["batched"]
        for setting, (seconds, head_s, calls, value) in results.items():
            rows.append({"runtime": name, "setting": setting, "tokens": count, "seconds": round(seconds, 2),
                         "lm_head_calls": calls, "lm_head_s": round(head_s, 3), "perplexity": value})
        rows[-1].update(speedup=round(slow / fast, 2), lm_head_speedup=round(slow_head / fast_head, 1),
                        perplexity_rel_diff=abs(ppl - ref) / ref)
    report = {"kernel": kernel_info(), "blas_default_threads": max_threads(), "windows": args.windows,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    for k in report["kernel"]:
        print(f"kernel: {kernel_name(k)}, default {max_threads()} threads, {os.cpu_count()} CPUs")
    print(f"SmolLM2-135M, {args.windows} x {WINDOW} tokens of {args.text.name}; load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"| {'runtime':<22} | {'lm_head':<12} | {'tokens':>6} | {'seconds':>8} | {'lm_head calls':>13} | "
          f"{'lm_head s':>9} | {'perplexity':>10} | {'speed-up (lm_head)':>18} | {'ppl rel. diff':>13} |")
    for r in rows:
        extra = (f"{r['speedup']:>8.2f}x ({r['lm_head_speedup']:>5.1f}x) | {r['perplexity_rel_diff']:>13.1e}"
                 if "speedup" in r else f"{'':>18} | {'':>13}")
        print(f"| {r['runtime']:<22} | {r['setting']:<12} | {r['tokens']:>6} | {r['seconds']:>8.2f} | "
              f"{r['lm_head_calls']:>13} | {r['lm_head_s']:>9.2f} | {r['perplexity']:>10.4f} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
