"""Conversion at scale: random-weight checkpoints with real Qwen2.5 configs → bm1684x W4BF16 bundles.

    python benchmarks/convert_scale.py [--models 0.5b 1.5b] [--workdir DIR] [--json]

For each model: writes a bf16 safetensors checkpoint (random weights, the real config's shapes) into a temp
directory, then runs `topq convert` in a fresh process for: --jobs 1 cold, --jobs 2 cold, --jobs 2 cached (same
recipe, new output path). Prints wall time, CPU time and peak RSS per phase (prepare = read config, build and
lower the program; units = quantize + pack every layer; write = stream the bundle), and checks that the three
bundles are byte-identical. Nothing large is committed: checkpoints and bundles live in the work directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from topq.io.safetensors import SafetensorsWriter  # noqa: E402

# The public config.json values of Qwen2.5-0.5B and Qwen2.5-1.5B (both tie their embeddings).
CONFIGS = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def write_checkpoint(directory: Path, dims: dict, seed: int = 0) -> int:
    """A Qwen2 checkpoint with N(0, 0.02) bf16 weights, written tensor by tensor. Returns its size in bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "bos_token_id": 151643, "eos_token_id": 151643, **dims}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    h, i, kv = dims["hidden_size"], dims["intermediate_size"], dims["num_key_value_heads"]
    d = h // dims["num_attention_heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (dims["vocab_size"], h))]
    for layer in range(dims["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.weight", (kv * d, h)), (p + "self_attn.k_proj.bias", (kv * d,)),
                   (p + "self_attn.v_proj.weight", (kv * d, h)), (p + "self_attn.v_proj.bias", (kv * d,)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)),
                   (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
    shapes.append(("model.norm.weight", (h,)))
    rng = np.random.default_rng(seed)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    manifest = [(name, bf16, shape) for name, shape in shapes]
    with SafetensorsWriter(directory / "model.safetensors", manifest, {"format": "pt"}) as writer:
        for name, shape in shapes:
            if name.endswith("norm.weight"):
                array = np.ones(shape, np.float32)
            else:
                array = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            writer.write(name, array.astype(bf16))
        writer.finish({"format": "pt"})
    return (directory / "model.safetensors").stat().st_size


def run_convert(recipe: Path, out: Path, jobs: int, cache: Path, no_cache: bool) -> dict:
    cmd = [sys.executable, "-m", "topq.core.cli", "convert", str(recipe), "--set", f"output.path={out}",
           "--jobs", str(jobs), "--cache-dir", str(cache), "--json"] + (["--no-cache"] if no_cache else [])
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"convert failed: {done.stderr.strip().splitlines()[-1]}")
    summary = json.loads(done.stdout)
    summary["process_wall_s"] = round(time.perf_counter() - started, 2)
    return summary


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], choices=sorted(CONFIGS))
    parser.add_argument("--workdir", type=Path, help="keep checkpoints and bundles here (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="topq-scale-"))
    results = []
    for model in args.models:
        ckpt = work / f"qwen2.5-{model}"
        started = time.perf_counter()
        size = write_checkpoint(ckpt, CONFIGS[model]) if not (ckpt / "model.safetensors").exists() \
            else (ckpt / "model.safetensors").stat().st_size
        gen_s = time.perf_counter() - started
        recipe = work / f"{model}.yaml"
        recipe.write_text(f"model: {{path: {ckpt}}}\nquant: {{scheme: w4bf16, group_size: 64}}\n"
                          f"target: {{chip: bm1684x}}\nstages: {{seq_length: 512, max_input_length: 128}}\n"
                          f"output: {{path: {work / 'unused.topq'}}}\n")
        cache = work / f"cache-{model}"
        runs = {
            "jobs1 cold": run_convert(recipe, work / f"{model}-j1.topq", 1, cache / "j1", no_cache=True),
            "jobs2 cold": run_convert(recipe, work / f"{model}-j2.topq", 2, cache / "j2", no_cache=False),
            "jobs2 cached": run_convert(recipe, work / f"{model}-j2b.topq", 2, cache / "j2", no_cache=False),
        }
        digests = {digest(Path(r["output"])) for r in runs.values()}
        results.append({"model": model, "checkpoint_bytes": size, "generate_s": round(gen_s, 1), "runs": runs,
                        "identical": len(digests) == 1})
        for r in runs.values():
            Path(r["output"]).unlink()
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'model':<6} {'run':<13} {'phase':<8} {'wall s':>8} {'cpu s':>8} {'peak RSS MiB':>13}")
    for res in results:
        for label, run in res["runs"].items():
            for phase, t in run["phases"].items():
                print(f"{res['model']:<6} {label:<13} {phase:<8} {t['wall_s']:>8.2f} {t['cpu_s']:>8.2f} "
                      f"{t['peak_rss_mib']:>13.0f}")
            print(f"{res['model']:<6} {label:<13} {'total':<8} {run['process_wall_s']:>8.2f}   "
                  f"(units built {run['units_built']}, reused {run['units_reused']}, bundle "
                  f"{run['bytes'] / 1e9:.2f} GB)")
        cold, cached = res["runs"]["jobs2 cold"]["process_wall_s"], res["runs"]["jobs2 cached"]["process_wall_s"]
        print(f"{res['model']}: checkpoint {res['checkpoint_bytes'] / 1e9:.2f} GB bf16; bundles identical: "
              f"{res['identical']}; cached / cold = {cached / cold:.0%}")


if __name__ == "__main__":
    main()
