"""Predictions of the bm1684x performance model next to public measurements.

    cd /work/main && python -m benchmarks.perf_table             # the table
    cd /work/main && python -m benchmarks.perf_table --json      # the same as one JSON object
    cd /work/main && python -m benchmarks.perf_table --calibrate # re-derive the one set of constants

The constants live in `topq.plugins.targets.bm1684x.perf.CALIBRATION`; `--calibrate` searches them
against the three BM1684X measurements only (bm1688 and the Qwen3.5 rows are never fitted).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from topq.core.family import ModelSpec, find_family  # noqa: E402  (after the sys.path line above)
from topq.core.plugins import get_plugins  # noqa: E402  (after the sys.path line above)
from topq.plugins.targets.bm1684x.perf import CALIBRATION, Calibration, predict  # noqa: E402  (after the sys.path line above)
from topq.plugins.targets.bm1684x.spec import SPECS  # noqa: E402  (after the sys.path line above)

CONFIGS = ROOT / "tests" / "data" / "configs"


@dataclass(frozen=True)
class Case:
    """A public measurement: batch 1, W4BF16 g64, lm_head W4BF16, prefill at the full sequence."""

    model: str  # config file stem under tests/data/configs
    chip: str
    seq_length: int
    tokens_per_s: float
    first_token_s: float | None
    calibrated: bool  # part of the calibration set (BM1684X) or only reported


CASES = (
    Case("qwen2.5-7b", "bm1684x", 512, 10.26, 0.652, True),
    Case("qwen3-4b", "bm1684x", 512, 15.86, 0.464, True),
    Case("deepseek-r1-distill-qwen-7b", "bm1684x", 2048, 8.30, 2.94, True),
    Case("qwen2.5-1.5b", "bm1688", 1024, 20.17, 1.283, False),
    Case("qwen3-4b", "bm1688", 512, 7.98, 1.656, False),
)

#: The paper's Qwen3.5 table (BM1684X, W4BF16, 2K context): model size (GB) and tokens/s, and the config the
#: qwen3_5 family predicts it from (tests/data/configs).
QWEN35 = (
    ("Qwen3.5-2B", 1.67, 30.00, "qwen3.5-2b"),
    ("Qwen3.5-4B", 3.00, 16.77, "qwen3.5-4b"),
    ("Qwen3.5-9B", 5.39, 9.84, "qwen3.5-9b"),
)


def load_spec(model: str) -> ModelSpec:
    config = json.loads((CONFIGS / f"{model}.json").read_text())
    return find_family(get_plugins().families, config).normalize(config)


def predict_case(case: Case, cal: Calibration = CALIBRATION) -> dict[str, Any]:
    return predict(load_spec(case.model), SPECS[case.chip], "w4bf16", case.seq_length, case.seq_length,
                   lm_head_quant="w4bf16", group_size=64, cal=cal)


def error_pct(predicted: float, measured: float) -> float:
    return (predicted / measured - 1.0) * 100.0


def case_rows(cal: Calibration = CALIBRATION) -> list[dict[str, Any]]:
    rows = []
    for case in CASES:
        p = predict_case(case, cal)
        row = {
            "model": case.model, "chip": case.chip, "seq_length": case.seq_length, "calibrated": case.calibrated,
            "decode_tps": p["decode_tps"], "measured_tps": case.tokens_per_s,
            "tps_error_pct": error_pct(p["decode_tps"], case.tokens_per_s),
            "ftl_s": p["ftl_s"], "measured_ftl_s": case.first_token_s,
            "ftl_error_pct": error_pct(p["ftl_s"], case.first_token_s) if case.first_token_s else None,
            "bytes_per_token": p["bytes_per_token"], "ddr_utilization": p["ddr_utilization"],
        }
        rows.append(row)
    return rows


def qwen35_rows(cal: Calibration = CALIBRATION) -> list[dict[str, Any]]:
    rows = []
    for name, size_gb, tps, config in QWEN35:
        spec = load_spec(config)
        p = predict(spec, SPECS["bm1684x"], "w4bf16", 2048, 512, lm_head_quant="bf16", cal=cal)
        w4_head = predict(spec, SPECS["bm1684x"], "w4bf16", 2048, 512, lm_head_quant="w4bf16", cal=cal)
        rows.append({
            "model": name, "paper_size_gb": size_gb, "paper_tps": tps,
            "paper_bw_util": tps * size_gb * 1e9 / SPECS["bm1684x"].ddr_bandwidth,
            "config": config, "bytes_per_token_gb": p["bytes_per_token"] / 1e9,
            "weight_gb": p["weight_bytes_per_token"] / 1e9, "state_mb": p["state_bytes_per_token"] / 1e6,
            "decode_tps_2k": p["decode_tps"], "decode_tps_512": p["decode_tps_by_context"]["512"],
            "ddr_utilization": p["ddr_utilization"], "decode_tps_2k_w4_lm_head": w4_head["decode_tps"],
        })
    return rows


# ------------------------------------------------------------------------------------------ calibration

#: The searched constants and their bounds (the overheads' lower bounds are a physical floor: a group
#: costs at least one DMA/TIU synchronisation, a call at least one runtime launch); vector_eff and
#: kv_per_query_head keep their value.
SEARCH = {
    "cube_eff": (0.2, 1.0),
    "attn_eff": (0.02, 1.0),
    "ddr_eff": (0.3, 1.0),
    "group_overhead_s": (1e-6, 100e-6),
    "launch_s": (10e-6, 500e-6),
}


def objective(cal: Calibration) -> tuple[float, float]:
    """(worst |log error|, sum of squared log errors) over the calibration set's tps and first-token times."""
    errors = []
    for case in CASES:
        if not case.calibrated:
            continue
        p = predict_case(case, cal)
        errors.append(math.log(p["decode_tps"] / case.tokens_per_s))
        if case.first_token_s:
            errors.append(math.log(p["ftl_s"] / case.first_token_s))
    return max(abs(e) for e in errors), sum(e * e for e in errors)


def calibrate(start: Calibration = CALIBRATION, rounds: int = 5) -> Calibration:
    """A coarse grid over the two compute efficiencies, then a coordinate search over every SEARCH constant with
    shrinking steps, minimising the worst error (then the squared sum)."""
    grid = [replace(start, cube_eff=c, attn_eff=a) for c in (0.4, 0.5, 0.6, 0.7, 0.8)
            for a in (0.05, 0.1, 0.2, 0.3, 0.4)]
    best = min(grid, key=objective)
    best_score = objective(best)
    step = 0.25
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for name, (lo, hi) in SEARCH.items():
                value = getattr(best, name)
                for factor in (1 - step, 1 + step):
                    trial = replace(best, **{name: min(hi, max(lo, value * factor))})
                    score = objective(trial)
                    if score < best_score:
                        best, best_score, improved = trial, score, True
        step /= 2
    return best


# ------------------------------------------------------------------------------------------ output


def format_table(rows: list[dict[str, Any]], q35: list[dict[str, Any]], cal: Calibration) -> str:
    out = [("bm1684x performance model vs public measurements (batch 1, W4BF16 g64, lm_head W4BF16, "
            "prefill at the full sequence)"), ""]
    out.append(f"{'model':<30}{'chip':<9}{'seq':>6}{'pred tok/s':>12}{'meas':>8}{'err':>8}"
               f"{'pred FTL s':>12}{'meas':>8}{'err':>8}{'GB/token':>10}{'DDR util':>10}")
    for r in rows:
        ftl_meas = f"{r['measured_ftl_s']:.3f}" if r["measured_ftl_s"] else "-"
        ftl_err = f"{r['ftl_error_pct']:+.1f}%" if r["ftl_error_pct"] is not None else "-"
        tag = "" if r["calibrated"] else " *"
        out.append(f"{r['model'] + tag:<30}{r['chip']:<9}{r['seq_length']:>6}{r['decode_tps']:>12.2f}"
                   f"{r['measured_tps']:>8.2f}{r['tps_error_pct']:>+7.1f}%{r['ftl_s']:>12.3f}{ftl_meas:>8}"
                   f"{ftl_err:>8}{r['bytes_per_token'] / 1e9:>10.3f}{r['ddr_utilization']:>9.1%}")
    out += ["* not in the calibration set (reported only)", "",
            ("Qwen3.5 (paper, BM1684X, W4BF16, 2K context) vs the qwen3_5 family's prediction from the "
             "published configs (w4bf16, lm_head bf16, seq 2048, decode with the 2K history); not fitted:"), ""]
    out.append(f"{'paper model':<13}{'size GB':>9}{'tok/s':>8}{'BW util':>9}   {'GB/token':>9}{'weights GB':>11}"
               f"{'state MB':>9}{'pred tok/s @2K':>16}{'@512':>8}{'DDR util':>10}{'pred/paper':>11}"
               f"{'W4 lm_head':>11}")
    for r in q35:
        out.append(f"{r['model']:<13}{r['paper_size_gb']:>9.2f}{r['paper_tps']:>8.2f}{r['paper_bw_util']:>9.1%}   "
                   f"{r['bytes_per_token_gb']:>9.3f}{r['weight_gb']:>11.3f}{r['state_mb']:>9.1f}"
                   f"{r['decode_tps_2k']:>16.2f}{r['decode_tps_512']:>8.2f}{r['ddr_utilization']:>9.1%}"
                   f"{r['decode_tps_2k'] / r['paper_tps']:>11.2f}{r['decode_tps_2k_w4_lm_head']:>11.2f}")
    out += ["", "calibration: " + ", ".join(f"{f.name}={_fmt(getattr(cal, f.name))}" for f in fields(cal))]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--calibrate", action="store_true", help="search the constants, then print the table")
    args = parser.parse_args(argv)
    cal = CALIBRATION
    if args.calibrate:
        cal = calibrate()
        worst, _ = objective(cal)
        print(f"calibrated (worst error {math.expm1(worst):+.1%}): {cal}", file=sys.stderr)
    rows, q35 = case_rows(cal), qwen35_rows(cal)
    if args.json:
        print(json.dumps({"cases": rows, "qwen35": q35, "calibration": asdict(cal)}))
    else:
        print(format_table(rows, q35, cal))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
