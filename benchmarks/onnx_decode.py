"""Prefill and decode speed of the onnx target (ONNX Runtime) vs the topq host runtime, transformers eager f32
and (when llama-cpp-python is installed) llama.cpp.

SmolLM2-135M-Instruct, W4 group-64 asymmetric (RTN, `w4bf16`), in one process with the same thread count for
every backend: a `--prefill`-token prompt (one prefill call) timed, then `--tokens` greedy decode steps after one
untimed warm-up step (the KV cache reused step to step). The onnx target runs two bundles — attention as
com.microsoft.GroupQueryAttention (`target.attention: gqa`) and as standard ops (`standard`) — each at MatMulNBits
accuracy_level 0 (float32 activations) and 4 (int8 activations); the table says how far each one's logits are
from the first onnx run's. transformers loads the same GGUF with its own code, in float32; llama.cpp runs the
GGUF file itself (its Q4_1 blocks of 32, not topq's W4 g64) with its own kernels.

    python -m benchmarks.onnx_decode                         # 512-token prefill, 32 decode steps, 2 threads
    python -m benchmarks.onnx_decode --tokens 8 --prefill 128 --json
    python -m benchmarks.onnx_decode --bundles out/           # reuse (or keep) the converted bundles in out/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters. ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill (default 512)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps to time (default 32)")
    p.add_argument("--threads", type=int, default=2, help="threads of every backend (default 2)")
    p.add_argument("--bundles", type=Path, help="directory for the converted bundles (reused when present)")
    p.add_argument("--skip", nargs="*", default=[], choices=("host", "transformers", "llama.cpp"),
                   help="backends to leave out (the host interpreter's prefill is slow)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.prefill < 1:
        p.error("--tokens and --prefill must be at least 1")
    return args


def convert_bundle(directory: Path, chip: str, prefill: int, tokens: int, **target: Any) -> Path:
    from benchmarks.host_decode import gguf_path
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    options = "".join(f"-{value}" for value in target.values())
    output = directory / f"smollm2-w4g64-{chip}{options}-{prefill}.topq"
    if not output.exists():
        recipe = recipe_from_defaults(
            model={"path": str(gguf_path())}, quant={"scheme": "w4bf16", "group_size": 64, "symmetric": False},
            target={"chip": chip, **target}, output={"path": str(output)},
            stages={"seq_length": prefill + tokens + 8, "max_input_length": prefill, "decode_chunks": []})
        convert(recipe, progress=False)
    return output


def time_session(bundle: Any, executor: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Prefill and decode on a fresh Session, after one untimed short conversation on the same executor (it
    creates the ORT sessions / interpreter plans of the prefill functions and the head)."""
    import numpy as np

    from topq.core.runtime import Session

    Session(bundle, executor=executor).feed(prompt[:8])
    session = Session(bundle, executor=executor)
    started = time.perf_counter()
    logits = session.feed(prompt)
    prefill_s = time.perf_counter() - started
    out = [int(np.argmax(logits))]
    rows = [logits]
    rows.append(session.decode(out[-1]))  # warm-up: creates the decode variant's sessions/plans
    out.append(int(np.argmax(rows[-1])))
    steps = []
    for _ in range(tokens):
        t = time.perf_counter()
        logits = session.decode(out[-1])
        steps.append(time.perf_counter() - t)
        out.append(int(np.argmax(logits)))
        rows.append(logits)
    return {"prefill_s": prefill_s, "steps": steps, "tokens": out, "logits": np.stack(rows)}


def time_llama_cpp(prompt: list[int], tokens: int, threads: int) -> dict[str, Any] | None:
    """llama.cpp (llama-cpp-python, optional) on the same GGUF file: one prompt evaluation, then greedy steps."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np

    from benchmarks.host_decode import gguf_path

    model = llama_cpp.Llama(str(gguf_path()), n_ctx=len(prompt) + tokens + 8, n_batch=len(prompt),
                            n_threads=threads, n_threads_batch=threads, verbose=False)
    model.eval(prompt[:8])  # untimed: first-call allocations
    model.reset()
    started = time.perf_counter()
    model.eval(prompt)
    prefill_s = time.perf_counter() - started
    out = [int(np.argmax(model.scores[model.n_tokens - 1]))]
    model.eval([out[-1]])  # warm-up step, as for the other backends
    out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
    steps = []
    for _ in range(tokens):
        t = time.perf_counter()
        model.eval([out[-1]])
        steps.append(time.perf_counter() - t)
        out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
    return {"prefill_s": prefill_s, "steps": steps, "tokens": out}


def time_transformers(prompt: list[int], tokens: int) -> dict[str, Any]:
    import torch

    from benchmarks.host_decode import gguf_path, load_transformers_model

    model = load_transformers_model(gguf_path())
    with torch.inference_mode():  # one untimed pass so lazy initialisation is not counted
        model(torch.tensor([prompt[:8]]))
    from benchmarks.host_decode import time_transformers as run

    return run(model, prompt, tokens)


def summarize(name: str, run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """One row; `logit_diff`: the largest |logit − the reference onnx run's| over the prompt's last position and
    every decode step (onnx runs only: the same tokens are fed when the greedy choices agree)."""
    import numpy as np

    ms = [s * 1e3 for s in run["steps"]]
    row = {"backend": name, "prefill_ms": round(run["prefill_s"] * 1e3, 1), "decoded": len(ms),
           "ms_per_token": round(statistics.fmean(ms), 2), "tokens_per_s": round(1e3 / statistics.fmean(ms), 2),
           "same_tokens": run["tokens"] == reference["tokens"]}
    if "logits" in run and run["logits"].shape == reference["logits"].shape and row["same_tokens"]:
        row["logit_diff"] = float(f"{float(np.abs(run['logits'] - reference['logits']).max()):.2g}")
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # before numpy / torch create their thread pools
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["TOPQ_ONNX_THREADS"] = str(args.threads)
    import torch

    from topq.core.bundle import Bundle
    from topq.core.runtime import open_executor
    from topq.plugins.targets.onnx.executor import OnnxExecutor

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="topq-bench-") as tmp:
        directory = args.bundles or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        runs: dict[str, dict[str, Any]] = {}
        for attention in ("gqa", "standard"):
            onnx_bundle = Bundle(convert_bundle(directory, "onnx", args.prefill, args.tokens, attention=attention))
            ids = onnx_bundle.tokenizer.encode(TEXT * (1 + args.prefill // 60))
            prompt = [int(t) for t in ids[:args.prefill]]
            assert len(prompt) == args.prefill, "the benchmark text is too short for --prefill"
            for level in (0, 4):
                executor = OnnxExecutor(onnx_bundle, accuracy_level=level)
                runs[f"onnx {attention}, level {level}"] = time_session(onnx_bundle, executor, prompt, args.tokens)
        if "host" not in args.skip:
            host_bundle = Bundle(convert_bundle(directory, "host", args.prefill, args.tokens))
            runs["topq host (numpy interpreter)"] = time_session(host_bundle, open_executor(host_bundle), prompt,
                                                                 args.tokens)
        if "transformers" not in args.skip:
            runs["transformers eager f32"] = time_transformers(prompt, args.tokens)
        if "llama.cpp" not in args.skip:
            llama = time_llama_cpp(prompt, args.tokens, args.threads)
            if llama is not None:
                runs["llama.cpp (GGUF Q4_1)"] = llama
            else:
                print("note: llama-cpp-python is not installed; no llama.cpp row", file=sys.stderr)
    first = next(iter(runs.values()))
    rows = [summarize(name, run, first) for name, run in runs.items()]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct W4 g64 asym", "prefill_tokens": args.prefill, "decoded_tokens": args.tokens,
        "threads": args.threads, "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "results": rows,
    }
    reference = next((r for r in rows if r["backend"].startswith("transformers")), None)
    if reference is not None:
        result["vs_transformers"] = {
            r["backend"]: {"decode": round(reference["ms_per_token"] / r["ms_per_token"], 2),
                           "prefill": round(reference["prefill_ms"] / r["prefill_ms"], 2)} for r in rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {args.prefill}-token prefill, {args.tokens} timed decode steps (after 1 warm-up), "
          f"{args.threads} threads, load average {result['load_average']} on {result['cpus']} CPUs")
    print(f"{'backend':<34} {'prefill ms':>11} {'ms/token':>9} {'tok/s':>7} {'decode ×tf':>11} {'prefill ×tf':>12} "
          f"{'same tokens':>12} {'max |Δlogit|':>13}")
    for row in rows:
        ratio = result.get("vs_transformers", {}).get(row["backend"], {})
        print(f"{row['backend']:<34} {row['prefill_ms']:>11} {row['ms_per_token']:>9} {row['tokens_per_s']:>7} "
              f"{ratio.get('decode', '-'):>11} {ratio.get('prefill', '-'):>12} {str(row['same_tokens']):>12} "
              f"{row.get('logit_diff', '-'):>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
