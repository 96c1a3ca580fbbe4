"""One peer quantization for benchmarks/quant_speed.py, run by the peers' own Python (benchmarks/setup_peers.sh
makes it; llm-compressor pins another transformers than topq's, so the peers cannot share topq's environment).

    .venv-peers/bin/python benchmarks/peer_quant.py --method gptq --model M.gguf --hf-dir /tmp/hf \
        --windows w.npy --eval e.npy

The model is read by transformers from the same GGUF as topq reads (float32, dequantized, saved once as a Hugging
Face checkpoint in `--hf-dir`: llm-compressor needs its config.json); the calibration windows and evaluation ids
are the ones topq used (int32 .npy files the parent wrote), so both tools see the same tokens.
W4, group 64, asymmetric, lm_head float (topq's rows keep it bf16). Methods:

* `gptq`: llm-compressor `GPTQModifier`, `actorder: static` (its default), dampening 0.01, block 128, min/max
  group ranges (its default observer); `gptq-mse`: the same with its `mse` observer (group ranges shrunk where that
  lowers the rounding error: the peer of topq's `scale_search: mse`);
* `awq`: llm-compressor `AWQModifier` (scale search and clipping: its defaults; on a machine without a GPU its
  cache's `pin_memory`, a staging step for GPU copies that fails there, is made a no-op);
* `autoround`: auto-round `AutoRound` with `--iters` steps, all windows as its samples, its defaults otherwise
  (minibatches of 8 windows, lr 1/iters).

Prints one JSON line: the perplexity on the evaluation ids (independent `--window`-token windows, as
`topq.core.runtime.perplexity`) and `seconds`, the wall time of loading the Hugging Face checkpoint and quantizing
(not of the GGUF conversion or the evaluation), and `peak_rss_mib`, this process's peak RSS (its own, not its
parent's: benchmarks/peak_rss.py), evaluation included.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peak_rss import own_peak_mib  # benchmarks/ (this script's directory: the peers' Python does not have topq)

WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}


def hf_checkpoint(gguf: Path, directory: Path) -> Path:
    """The GGUF as a float32 Hugging Face checkpoint (once; not timed): llm-compressor reads the model's config
    from its directory, which a GGUF does not have."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (directory / "config.json").exists():
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(directory)
        read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = read.config
        del config.quantization_config  # the GGUF's: a model read from GGUF refuses save_pretrained
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read.state_dict())
        model.save_pretrained(directory)
    return directory


def load(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def tokenizer(checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def llm_compressor(model: Any, windows: np.ndarray, method: str, source: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot

    if method in ("gptq", "gptq-mse"):
        from llmcompressor.modifiers.gptq import GPTQModifier

        weights = {**WEIGHTS, "actorder": "static", **({"observer": "mse"} if method == "gptq-mse" else {})}
        recipe: Any = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                   ignore=["lm_head"], dampening_frac=0.01, block_size=128)
    else:
        from llmcompressor.modifiers.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        if not torch.cuda.is_available():  # 0.14's AWQ pins its cache for copies to a GPU, which fails without one
            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]

        recipe = AWQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": WEIGHTS}},
                             ignore=["lm_head"])
    data = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": np.ones_like(windows).tolist()})
    oneshot(model=model, processor=tokenizer(source), dataset=data, recipe=recipe, num_calibration_samples=len(windows),
            max_seq_length=windows.shape[1], shuffle_calibration_samples=False)


def auto_round(model: Any, windows: np.ndarray, iters: int, source: Path) -> None:
    from auto_round import AutoRound

    data = [{"input_ids": torch.tensor(w[None]), "attention_mask": torch.ones(1, len(w), dtype=torch.long)}
            for w in windows]
    rounder = AutoRound(model, tokenizer(source), bits=4, group_size=64, sym=False, iters=iters, nsamples=len(windows),
                        seqlen=windows.shape[1], dataset=data)  # its other settings (batch_size 8, lr 1/iters) default
    rounder.quantize()


def perplexity(model: Any, ids: np.ndarray, window: int) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window], dtype=torch.long)
            if len(chunk) < 2:
                break
            logprobs = torch.log_softmax(model(chunk[None]).logits[0].double(), dim=-1)
            targets = chunk[1:]
            total -= float(logprobs[torch.arange(len(targets)), targets].sum())
            count += len(targets)
    return float(np.exp(total / count))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("gptq", "gptq-mse", "awq", "autoround"), required=True)
    p.add_argument("--model", type=Path, required=True, help="the GGUF file topq converted")
    p.add_argument("--hf-dir", type=Path, required=True, help="where the GGUF's Hugging Face form is kept")
    p.add_argument("--windows", type=Path, required=True, help="calibration windows, int32 [samples, seq_len]")
    p.add_argument("--eval", type=Path, required=True, help="evaluation token ids, int32")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    torch.manual_seed(0)
    checkpoint = hf_checkpoint(args.model, args.hf_dir)
    windows = np.load(args.windows)
    started = time.perf_counter()
    model = load(checkpoint)
    if args.method == "autoround":
        auto_round(model, windows, args.iters, checkpoint)
    else:
        llm_compressor(model, windows, args.method, checkpoint)
    seconds = time.perf_counter() - started
    model.eval()
    ppl = perplexity(model, np.load(args.eval), args.window)
    print(json.dumps({"perplexity": ppl, "seconds": seconds, "peak_rss_mib": own_peak_mib()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
