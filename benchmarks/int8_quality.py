"""Perplexity of SmolLM2-135M under W8A8 int8: float vs static per-tensor (each observer), SmoothQuant, per-token
dynamic and mixed precision.

    cd /work/main && python -m benchmarks.int8_quality                                  # full setting
    cd /work/main && python -m benchmarks.int8_quality --samples 8 --seq-len 256 --eval-windows 2 --window 256

Calibration: `--samples` × `--seq-len` tokens of 00_EMMA.txt; evaluation: the first `--eval-windows` × `--window`
tokens of 03_Persuasion.txt, perplexity of host bundles (independent windows). The lm_head stays bf16 (default).
Mixed precision holds out a quarter of the calibration windows (at most 4,096 tokens) for its perplexity search.
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

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "float": ("float (f32)", "f32", {}),
    "bf16": ("bf16", "bf16", {}),
    "minmax": ("int8 static minmax", "int8", {"observer": "minmax"}),
    "percentile": ("int8 static percentile 99.99", "int8", {"observer": "percentile", "percentile": 99.99}),
    "kl": ("int8 static KL", "int8", {"observer": "kl"}),
    "smooth": ("int8 static minmax + SmoothQuant a=0.5", "int8", {"observer": "minmax", "smooth_alpha": 0.5}),
    "dynamic": ("int8 per-token dynamic", "int8", {"dynamic_tokens": True}),
    "smooth_dynamic": ("int8 per-token dynamic + SmoothQuant a=0.5", "int8", {"dynamic_tokens": True,
                                                                            "smooth_alpha": 0.5}),
    "mixed": ("int8 minmax, mixed precision budget 1.05", "int8", {"observer": "minmax", "budget": 1.05}),
    "smooth_mixed": ("int8 minmax + SmoothQuant a=0.5, mixed budget 1.05", "int8",
                     {"observer": "minmax", "smooth_alpha": 0.5, "budget": 1.05}),
}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quant_quality import add_setting_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_arguments(parser)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    parser.add_argument("--budget", type=float, default=None,
                        help="perplexity budget of the mixed-precision rows on held-out calibration text (1.05)")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import yaml

    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults
    from topq.core.runtime import perplexity

    tmp = tempfile.TemporaryDirectory(prefix="topq-int8-")
    out_dir = args.out_dir or Path(tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_ids: list[int] | None = None
    results = []
    for key in args.rows.split(","):
        label, scheme, quant = ROWS[key]
        if "budget" in quant and args.budget is not None:
            quant = {**quant, "budget": args.budget}
            label = label.replace("budget 1.05", f"budget {args.budget}")
        path = out_dir / f"{key}.topq"
        table = out_dir / f"{key}.table.yaml"
        if table.exists():
            table.unlink()
        extra = {"table": str(table)} if scheme == "int8" else {}
        recipe = recipe_from_defaults(
            model={"path": args.model},
            quant={"scheme": scheme, **quant, **extra,
                   "calibration": {"data": str(args.calibration), "samples": args.samples, "seq_len": args.seq_len,
                                   "seed": args.seed}},
            target={"chip": "host"},
            stages={"seq_length": args.window, "max_input_length": args.window, "prefill_kv": False,
                    "decode_chunks": []},
            output={"path": str(path)})
        started = time.perf_counter()
        convert(recipe)
        seconds = time.perf_counter() - started
        bundle = Bundle(path)
        if eval_ids is None:
            needed = args.eval_windows * args.window
            text = args.eval_text.read_text(encoding="utf-8")
            eval_ids = list(bundle.tokenizer(text[:needed * 8], add_special_tokens=False)["input_ids"][:needed])
        ppl, count = perplexity(bundle, eval_ids, window=args.window)
        row: dict[str, Any] = {"row": label, "perplexity": round(ppl, 3), "tokens": count, "seconds": round(seconds, 1)}
        if "budget" in quant:
            doc = yaml.safe_load(table.read_text())
            row["bf16_linears"] = sum(v["mode"] == "bf16" for v in doc["layers"].values())
            row["linears"] = len(doc["layers"])
            row["search"] = doc.get("mixed_precision")
        results.append(row)
        print(f"{label:44s} ppl {ppl:9.3f}  convert {seconds:7.1f} s", file=sys.stderr, flush=True)
    print(f"\nSmolLM2-135M, calib {args.samples}x{args.seq_len} EMMA, "
          f"eval {args.eval_windows}x{args.window} Persuasion")
    print(f"| {'row':44s} | perplexity | convert s |")
    print(f"|{'-' * 46}|-----------:|----------:|")
    for r in results:
        note = f" ({r['bf16_linears']}/{r['linears']} linears bf16)" if "bf16_linears" in r else ""
        print(f"| {r['row'] + note:44s} | {r['perplexity']:10.3f} | {r['seconds']:9.1f} |")
    clipping = clipping_table(out_dir)
    if clipping:
        print("\nclipping thresholds T / absmax (static observers vs minmax, per linear kind: median, min)")
        for line in clipping:
            print(line)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    tmp.cleanup()
    return 0


def clipping_table(out_dir: Path) -> list[str]:
    """How far percentile / KL clip below the observed maximum: their input and output thresholds over minmax's,
    from the calibration tables of rows that ran in this invocation."""
    import numpy as np
    import yaml

    def load(key: str) -> dict[str, Any] | None:
        path = out_dir / f"{key}.table.yaml"
        return yaml.safe_load(path.read_text())["layers"] if path.exists() else None

    reference = load("minmax")
    lines = []
    for key in ("percentile", "kl"):
        table = load(key)
        if reference is None or table is None:
            continue
        for kind in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            names = [n for n in table if f".{kind}." in n]
            t_in = np.array([table[n]["act_scale"] / reference[n]["act_scale"] for n in names])
            t_out = np.array([table[n]["out_scale"] / reference[n]["out_scale"] for n in names])
            lines.append(f"{key:10s} {kind:9s} input {np.median(t_in):.4f} {t_in.min():.4f}   "
                         f"output {np.median(t_out):.4f} {t_out.min():.4f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
