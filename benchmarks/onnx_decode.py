"""Prefill and decode speed of the onnx target (ONNX Runtime) vs the topq host runtime, transformers eager f32
and (when llama-cpp-python is installed) llama.cpp.

SmolLM2-135M-Instruct, W4 group-64 asymmetric (RTN, `w4bf16`), in one process with the same thread count for
every backend. The onnx target runs two bundles — attention as com.microsoft.GroupQueryAttention
(`target.attention: gqa`) and as standard ops (`standard`) — each at MatMulNBits accuracy_level 0 (float32
activations) and 4 (int8 activations). transformers loads the same GGUF with its own code, in float32; llama.cpp
runs the GGUF file itself (its Q4_1 blocks of 32, not topq's W4 g64) with its own kernels.

The machine is shared, so the backends are timed *interleaved*: each of `--repeats` rounds runs the
`--prefill`-token prompt (one fresh prefill) on every backend in turn, and the decode steps go round-robin (every
backend's step k before any backend's step k+1), after one untimed warm-up step each. Prefill is the fastest
round, decode the median step, so a burst of load elsewhere hits every backend alike. Beside wall time the table
gives the process CPU time of the same calls (all threads; ORT's idle threads do not spin): the work done,
which waiting for a busy core does not inflate. The table also gives, per
backend, whether its greedy tokens equal the first onnx run's and then the largest logit difference to it (over
the prompt's last position and every decode step): equal numerics is the condition for comparing speeds.

    python -m benchmarks.onnx_decode                         # 512-token prefill, 32 decode steps, 2 threads
    python -m benchmarks.onnx_decode --tokens 8 --prefill 128 --json
    python -m benchmarks.onnx_decode --bundles out/           # reuse (or keep) the converted bundles in out/
    python -m benchmarks.onnx_decode --seq-length 2048 --decode-chunks 1024   # decode on a half-filled history
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
BACKENDS = ("onnx", "host", "transformers", "llama.cpp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill (default 512)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps to time (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="prefill rounds; the fastest counts (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads of every backend (default 2)")
    p.add_argument("--seq-length", type=int, help="stages.seq_length (default: prefill + tokens + 8, one decode "
                   "function whose history the conversation nearly fills)")
    p.add_argument("--decode-chunks", type=int, nargs="*", default=[],
                   help="stages.decode_chunks: shorter decode variants (default none)")
    p.add_argument("--bundles", type=Path, help="directory for the converted bundles (reused when present)")
    p.add_argument("--skip", nargs="*", default=[], choices=BACKENDS[1:],
                   help="backends to leave out (the host interpreter's prefill is slow)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.prefill < 1 or args.repeats < 1:
        p.error("--tokens, --prefill and --repeats must be at least 1")
    return args


def convert_bundle(directory: Path, chip: str, args: argparse.Namespace, **target: Any) -> Path:
    from benchmarks.host_decode import gguf_path
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    prefill, seq_length = args.prefill, args.seq_length or args.prefill + args.tokens + 8
    options = "".join(f"-{value}" for value in target.values())
    chunks = "".join(f"-{c}" for c in args.decode_chunks)
    output = directory / f"smollm2-w4g64-{chip}{options}-{prefill}-{seq_length}{chunks}.topq"
    if not output.exists():
        recipe = recipe_from_defaults(
            model={"path": str(gguf_path())}, quant={"scheme": "w4bf16", "group_size": 64, "symmetric": False},
            target={"chip": chip, **target}, output={"path": str(output)},
            stages={"seq_length": seq_length, "max_input_length": prefill, "decode_chunks": args.decode_chunks})
        convert(recipe, progress=False)
    return output


class TopqBackend:
    """A topq bundle on an executor: `prefill` starts a fresh Session, `step` decodes one token on it."""

    def __init__(self, bundle: Any, executor: Any) -> None:
        from topq.core.runtime import Session

        self.bundle, self.executor, self.new_session = bundle, executor, Session
        self.session: Any = None
        self.new_session(bundle, executor=executor).feed([1, 2, 3, 4, 5, 6, 7, 8])  # untimed: creates the sessions

    def prefill(self, prompt: list[int]) -> Any:
        self.session = self.new_session(self.bundle, executor=self.executor)
        return self.session.feed(prompt)

    def step(self, token: int) -> Any:
        return self.session.decode(token)


class TransformersBackend:
    def __init__(self) -> None:
        import inspect

        import torch

        from benchmarks.host_decode import gguf_path, load_transformers_model

        self.torch = torch
        self.model = load_transformers_model(gguf_path())
        # transformers 5.x renamed the forward argument `past_key_values` to `cache` (the old name warns)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.kwargs: dict[str, Any] = {}
        self.prefill([1, 2, 3, 4, 5, 6, 7, 8])  # untimed: lazy initialisation

    def prefill(self, prompt: list[int]) -> Any:
        from transformers import DynamicCache

        self.kwargs = {self.cache_arg: DynamicCache(), "use_cache": True}
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([prompt]), **self.kwargs).logits[0, -1].numpy()

    def step(self, token: int) -> Any:
        with self.torch.inference_mode():
            return self.model(self.torch.tensor([[token]]), **self.kwargs).logits[0, -1].numpy()


class LlamaCppBackend:
    """llama.cpp through llama-cpp-python (optional; the product never imports it) on the same GGUF file."""

    def __init__(self, context: int, threads: int) -> None:
        import llama_cpp

        from benchmarks.host_decode import gguf_path

        self.llama_cpp = llama_cpp
        self.model = llama_cpp.Llama(str(gguf_path()), n_ctx=context, n_batch=context, n_threads=threads,
                                     n_threads_batch=threads, verbose=False)
        self.prefill([1, 2, 3, 4, 5, 6, 7, 8])  # untimed: first-call allocations

    def _last(self) -> Any:
        """The last position's logits (without logits_all, llama-cpp-python 0.3 no longer copies them to
        `scores`; only the batch's last token computes logits, so the lm_head runs once per call as elsewhere)."""
        import numpy as np

        row = self.llama_cpp.llama_get_logits_ith(self.model.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.model.n_vocab(),)).copy()

    def prefill(self, prompt: list[int]) -> Any:
        self.model.reset()
        self.model.eval(prompt)
        return self._last()

    def step(self, token: int) -> Any:
        self.model.eval([token])
        return self._last()


def measure(backends: dict[str, Any], prompt: list[int], tokens: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Interleaved timing (module docstring): fastest of `repeats` prefills, then round-robin decode steps."""
    import numpy as np

    runs: dict[str, dict[str, Any]] = {name: {"prefill_s": [], "steps": [], "prefill_cpu": [], "steps_cpu": []}
                                       for name in backends}
    for _ in range(repeats):
        for name, backend in backends.items():
            started, cpu = time.perf_counter(), time.process_time()
            logits = backend.prefill(prompt)
            runs[name]["prefill_s"].append(time.perf_counter() - started)
            runs[name]["prefill_cpu"].append(time.process_time() - cpu)
            runs[name]["logits"] = [np.asarray(logits, np.float32)]
            runs[name]["tokens"] = [int(np.argmax(logits))]
    for name, backend in backends.items():  # untimed warm-up step: creates the decode variant's sessions / plans
        logits = backend.step(runs[name]["tokens"][-1])
        runs[name]["logits"].append(np.asarray(logits, np.float32))
        runs[name]["tokens"].append(int(np.argmax(logits)))
    for _ in range(tokens):
        for name, backend in backends.items():
            started, cpu = time.perf_counter(), time.process_time()
            logits = backend.step(runs[name]["tokens"][-1])
            runs[name]["steps"].append(time.perf_counter() - started)
            runs[name]["steps_cpu"].append(time.process_time() - cpu)
            runs[name]["logits"].append(np.asarray(logits, np.float32))
            runs[name]["tokens"].append(int(np.argmax(logits)))
    return runs


def summarize(name: str, run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    ms = statistics.median(s * 1e3 for s in run["steps"])
    row: dict[str, Any] = {
        "backend": name, "prefill_ms": round(min(run["prefill_s"]) * 1e3, 1), "decoded": len(run["steps"]),
        "ms_per_token": round(ms, 2), "tokens_per_s": round(1e3 / ms, 2),
        "prefill_cpu_ms": round(min(run["prefill_cpu"]) * 1e3, 1),
        "cpu_ms_per_token": round(statistics.median(s * 1e3 for s in run["steps_cpu"]), 2),
        "same_tokens": run["tokens"] == reference["tokens"]}
    if row["same_tokens"]:
        row["logit_diff"] = float(f"{float(np.abs(np.stack(run['logits']) - np.stack(reference['logits'])).max()):.2g}")
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
    notes = []
    with tempfile.TemporaryDirectory(prefix="topq-bench-") as tmp:
        directory = args.bundles or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        backends: dict[str, Any] = {}
        prompt: list[int] = []
        for attention in ("gqa", "standard"):
            bundle = Bundle(convert_bundle(directory, "onnx", args, attention=attention))
            ids = bundle.tokenizer.encode(TEXT * (1 + args.prefill // 60))
            prompt = [int(t) for t in ids[:args.prefill]]
            assert len(prompt) == args.prefill, "the benchmark text is too short for --prefill"
            for level in (0, 4):
                backends[f"onnx {attention}, level {level}"] = TopqBackend(
                    bundle, OnnxExecutor(bundle, accuracy_level=level))
        if "host" not in args.skip:
            host = Bundle(convert_bundle(directory, "host", args))
            backends["topq host (numpy interpreter)"] = TopqBackend(host, open_executor(host))
        if "transformers" not in args.skip:
            backends["transformers eager f32"] = TransformersBackend()
        if "llama.cpp" not in args.skip:
            try:
                backends["llama.cpp (GGUF Q4_1)"] = LlamaCppBackend(args.seq_length or args.prefill + args.tokens + 8,
                                                                    args.threads)
            except ImportError:
                notes.append("llama-cpp-python is not installed: no llama.cpp row")
        load_before = os.getloadavg()
        runs = measure(backends, prompt, args.tokens, args.repeats)
        load_after = os.getloadavg()
    first = next(iter(runs.values()))
    rows = [summarize(name, run, first) for name, run in runs.items()]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct W4 g64 asym", "prefill_tokens": args.prefill, "decoded_tokens": args.tokens,
        "seq_length": args.seq_length or args.prefill + args.tokens + 8, "decode_chunks": args.decode_chunks,
        "repeats": args.repeats, "threads": args.threads, "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "results": rows, "notes": notes,
    }
    for base in ("transformers eager f32", "llama.cpp (GGUF Q4_1)"):
        reference = next((r for r in rows if r["backend"] == base), None)
        if reference is not None:
            result[f"vs {base}"] = {
                r["backend"]: {"decode": round(reference["ms_per_token"] / r["ms_per_token"], 2),
                               "prefill": round(reference["prefill_ms"] / r["prefill_ms"], 2)} for r in rows}
    if args.json:
        print(json.dumps(result))
        return 0
    load = result["load_average"]
    print(f"{result['model']}: {args.prefill}-token prefill (fastest of {args.repeats}), median of {args.tokens} "
          f"decode steps (after 1 warm-up), seq_length {result['seq_length']}, decode_chunks {args.decode_chunks}, "
          f"interleaved, {args.threads} threads, {result['cpus']} CPUs, "
          f"load average {load['before']} before, {load['after']} after")
    vs_tf = result.get("vs transformers eager f32", {})
    vs_llama = result.get("vs llama.cpp (GGUF Q4_1)", {})
    print(f"{'backend':<31} {'prefill ms':>10} {'ms/token':>9} {'tok/s':>7} {'cpu prefill':>11} {'cpu/token':>9} "
          f"{'decode×tf':>9} {'prefill×tf':>10} {'decode×llama':>12} {'prefill×llama':>13} {'same tokens':>11} "
          f"{'max|Δlogit|':>11}")
    for row in rows:
        tf, ll = vs_tf.get(row["backend"], {}), vs_llama.get(row["backend"], {})
        print(f"{row['backend']:<31} {row['prefill_ms']:>10} {row['ms_per_token']:>9} {row['tokens_per_s']:>7} "
              f"{row['prefill_cpu_ms']:>11} {row['cpu_ms_per_token']:>9} "
              f"{tf.get('decode', '-'):>9} {tf.get('prefill', '-'):>10} {ll.get('decode', '-'):>12} "
              f"{ll.get('prefill', '-'):>13} {str(row['same_tokens']):>11} {row.get('logit_diff', '-'):>11}")
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
