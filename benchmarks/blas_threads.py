"""Decode speed with BLAS threads chosen per call vs OpenBLAS's default threads, idle and under load, next to
transformers (float32, eager), all in one process.

    cd /work/main && python -m benchmarks.blas_threads --dir /tmp/bench            # idle + 2 busy processes
    cd /work/main && python -m benchmarks.blas_threads --dir /tmp/bench --load 3 --tokens 24 --json
    cd /work/main && python -m benchmarks.blas_threads --dir /tmp/bench --rounds 3 --tokens 10  # alternated

Settings: `per-call` is topq's default (`TOPQ_BLAS_THREADS=auto`: decode single-threaded, prefill at the
library's default); `fixed` runs every call at the library's default thread count (`TOPQ_BLAS_THREADS=N`, what
topq did before). `--load N` starts N busy-looping processes for the loaded rows (the situation of a shared
machine). transformers runs in two settings: torch's default intra-op threads (what it does unless told) and one
thread (its best setting on a busy machine, the fair peer of topq's single-threaded decode); its model is loaded
once. The runtimes decode interleaved, one step of each in turn, so they all meet the same load from other
processes; `--rounds N` alternates idle and loaded phases N times and takes medians over all of them. The table
prints tokens/s and loaded / idle per runtime; the kernel line says which BLAS ran (library, version, the core
type OpenBLAS chose, OPENBLAS_CORETYPE if the environment forces one). Do not set OPENBLAS_NUM_THREADS: the point
is the library's default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.emulator_decode import PROMPT, bundle_for, smol_transformers, summary  # noqa: E402


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """`processes` CPU-bound processes for the duration of the block."""
    stop = multiprocessing.Event()
    workers = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(processes)]
    for w in workers:
        w.start()
    time.sleep(0.5)  # let them reach the scheduler
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=5)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextmanager
def topq_threads(value: str) -> Iterator[None]:
    from topq.ir.threads import ENV

    old = os.environ.get(ENV)
    os.environ[ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


Stepper = Callable[[int], Any]


def topq_opener(bundle: Any, executor: Callable[[], Any]) -> Callable[[list[int]], tuple[Stepper, int]]:
    def open_session(prompt: list[int]) -> tuple[Stepper, int]:
        import numpy as np

        from topq.core.runtime import Session

        session = Session(bundle, executor())
        return session.decode, int(np.argmax(session.feed(prompt)))

    return open_session


def transformers_opener(model: Any) -> Callable[[list[int]], tuple[Stepper, int]]:
    def open_cache(prompt: list[int]) -> tuple[Stepper, int]:
        import torch

        with torch.inference_mode():
            out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values

        def step(token: int) -> Any:
            nonlocal cache
            with torch.inference_mode():
                result = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            return result.logits[0, -1].numpy()

        return step, int(out.logits[0, -1].argmax())

    return open_cache


def interleaved(runners: dict[tuple[str, str], tuple[Callable[[list[int]], tuple[Stepper, int]], Callable[[], Any]]],
                prompt: list[int], tokens: int) -> dict[tuple[str, str], list[float]]:
    """Greedy decode `tokens` steps of every runner, one step of each in turn, so that all of them meet the same
    load from other processes (which drifts over the seconds a whole run of one runner takes). Each runner feeds the
    prompt and decodes one untimed warm-up step first."""
    import numpy as np

    state: dict[tuple[str, str], list[Any]] = {}
    for key, (opener, context) in runners.items():
        with context():
            step, token = opener(prompt)
            state[key] = [step, int(np.argmax(step(token)))]
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for _ in range(tokens):
        for key, (_, context) in runners.items():
            step, token = state[key]
            with context():
                started = time.perf_counter()
                logits = step(token)
                times[key].append(time.perf_counter() - started)
            state[key][1] = int(np.argmax(logits))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, help="where bundles are written / reused (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps per run (default 16)")
    p.add_argument("--load", type=int, default=2, help="busy processes for the loaded rows (default 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="idle / loaded rounds, alternated; medians over rounds (default 1; more cancel the drift of "
                        "other processes' load)")
    p.add_argument("--skip-emulator", action="store_true", help="time only the host runtime and transformers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if "OPENBLAS_NUM_THREADS" in os.environ:
        print("note: OPENBLAS_NUM_THREADS is set; the 'fixed' rows use it as the library's default", file=sys.stderr)

    import torch

    from topq.core.bundle import Bundle
    from topq.ir.threads import kernel_info, kernel_name, max_threads
    from topq.plugins.targets.bm1684x import open_bundle
    from topq.plugins.targets.bm1684x.spec import BM1684X

    directory = args.dir or Path(tempfile.mkdtemp(prefix="topq-threads-"))
    directory.mkdir(parents=True, exist_ok=True)
    host = Bundle(bundle_for(directory, "host", "f32"))
    default = max_threads()
    model = smol_transformers()
    torch_default = torch.get_num_threads()
    bundles = {"topq host f32": (host, lambda: None)}
    if not args.skip_emulator:
        emu = Bundle(bundle_for(directory, "bm1684x", "w4bf16"))
        bundles["topq emulator w4bf16"] = (emu, lambda: open_bundle(emu, BM1684X, checker=False))
    #: (runtime, setting) → (opener: prompt → (step, first token), the context its steps run in)
    runners: dict[tuple[str, str], tuple[Callable[[list[int]], tuple[Stepper, int]], Callable[[], Any]]] = {}
    for name, (bundle, executor) in bundles.items():
        for setting, value in (("per-call", "auto"), ("fixed", str(default))):
            runners[name, setting] = (topq_opener(bundle, executor), lambda value=value: topq_threads(value))
    # torch's default threads (what transformers does unless told) and one thread (its best on a busy machine)
    for count in dict.fromkeys((torch_default, 1)):
        runners["transformers f32 eager", f"torch {count} threads"] = (
            transformers_opener(model), lambda count=count: torch_threads(count))
    tok = host.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    load_before = os.getloadavg()
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for load in (0, args.load):
            with busy(load):
                for (name, setting), t in interleaved(runners, prompt, args.tokens).items():
                    times.setdefault((name, setting, load), []).extend(t)
    rows = [{"runtime": name, "setting": setting, "load": load, **summary(t)}
            for (name, setting, load), t in sorted(times.items(), key=lambda kv: kv[0][2])]
    idle = {(r["runtime"], r["setting"]): r["tokens_per_s"] for r in rows if r["load"] == 0}
    for r in rows:
        r["loaded_over_idle"] = round(r["tokens_per_s"] / idle[(r["runtime"], r["setting"])], 3)
    report = {"kernel": kernel_info(), "blas_default_threads": default, "cpus": os.cpu_count(),
              "loadavg_before": load_before, "tokens": args.tokens, "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    for k in report["kernel"]:
        print(f"kernel: {kernel_name(k)}, default {default} threads, {os.cpu_count()} CPUs")
    print(f"{'runtime':<24}{'setting':<18}{'load':>5}{'tok/s':>9}{'ms/token':>10}{'loaded/idle':>13}")
    for r in rows:
        print(f"{r['runtime']:<24}{r['setting']:<18}{r['load']:>5}{r['tokens_per_s']:>9.2f}{r['ms_per_token']:>10.2f}"
              f"{r['loaded_over_idle']:>13.3f}")
    print(f"load average before: {load_before}, at the end: {os.getloadavg()}; {args.rounds} round(s) of "
          f"{args.tokens} interleaved tokens per row and phase, median ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
