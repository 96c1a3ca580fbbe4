"""Time the Top IR round trip on the 32-layer, three-stage test model (tests/helpers/ir_gen.py).

    python benchmarks/ir_roundtrip.py [--layers 32] [--repeat 5] [--json]

Each step is timed `--repeat` times and the best is reported (the least disturbed run). The parse target
is < 0.3 s for the ≥ 2,000-op module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "helpers")]  # run from a checkout without installing

from ir_gen import Dims, build_module  # noqa: E402

from topq.ir.parser import parse_module  # noqa: E402
from topq.ir.printer import print_module  # noqa: E402
from topq.ir.verifier import verify_module  # noqa: E402

PARSE_TARGET_S = 0.3


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run(layers: int, repeat: int) -> dict[str, Any]:
    build_s, module = best_of(repeat, lambda: build_module(Dims(layers=layers)))
    print_s, text = best_of(repeat, lambda: print_module(module))
    parse_s, parsed = best_of(repeat, lambda: parse_module(text))
    verify_s, _ = best_of(repeat, lambda: verify_module(parsed))
    if print_module(parsed) != text:  # a benchmark of a broken round trip would be meaningless
        raise SystemExit("error: print -> parse -> print is not byte-identical")
    return {
        "ops": module.num_ops(),
        "functions": len(module.functions),
        "text_bytes": len(text.encode("utf-8")),
        "lines": text.count("\n"),
        "repeat": repeat,
        "build_s": build_s,
        "print_s": print_s,
        "parse_s": parse_s,
        "verify_s": verify_s,
        "parse_ops_per_s": module.num_ops() / parse_s,
        "parse_target_s": PARSE_TARGET_S,
        "parse_within_target": parse_s < PARSE_TARGET_S,
    }


def table(r: dict[str, Any]) -> str:
    rows = [f"Top IR round trip: {r['ops']} ops, {r['functions']} functions, {r['lines']} lines, "
            f"{r['text_bytes'] / 1e6:.2f} MB (best of {r['repeat']})",
            f"{'step':<8}{'seconds':>10}{'ops/s':>12}"]
    for step in ("build", "print", "parse", "verify"):
        seconds = r[f"{step}_s"]
        rows.append(f"{step:<8}{seconds:>10.4f}{r['ops'] / seconds:>12,.0f}")
    verdict = "ok" if r["parse_within_target"] else "SLOWER THAN TARGET"
    rows.append(f"parse target < {r['parse_target_s']} s: {verdict}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (3 functions each)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per step; the best is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.repeat < 1:
        parser.error("--layers and --repeat must be at least 1")
    result = run(args.layers, args.repeat)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
