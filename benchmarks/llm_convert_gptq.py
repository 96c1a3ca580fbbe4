"""TPU-MLIR's own `llm_convert.py` on topq's `export gptq` output, against topq's `export tpu-mlir`, on cmodel.

    TOPQ_TPU_MLIR_LLM_CONVERT=1 bash scripts/setup-tpu-mlir.sh VENV      # TPU-MLIR + torch + transformers
    python benchmarks/llm_convert_gptq.py --tpu-mlir VENV/bin/python [--workdir DIR]

A tiny random Qwen2 (2 layers, hidden 64; layer 0 is compared: llm_convert folds the final norm into the last block,
so the last block's hidden output differs by design) is quantized by topq's GPTQ (bm1684x bundle, W4 group 32,
asymmetric), then (1) `topq export gptq` writes it as a Hugging Face GPTQ checkpoint, which `llm_convert.py -q
w4bf16 -g 32` compiles into bmodels; (2) `topq export tpu-mlir` (pre-quantized route) compiles the same bundle's
block nets. Both block_0 (prefill) and block_cache_0 (decode) bmodels run on TPU-MLIR's simulator (model_runner.py)
with the same inputs; the table says whether their outputs are bit-identical and their cosine to topq's bm1684x
emulator, plus the wall time of each conversion (they run one after the other in this process's children).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from topq.core.bundle import Bundle  # noqa: E402
from topq.core.cli import main as topq_main  # noqa: E402
from topq.core.pipeline import convert  # noqa: E402
from topq.core.plugins import get_plugins  # noqa: E402
from topq.core.recipe import recipe_from_defaults  # noqa: E402
from topq.plugins.exporters.tpu_mlir.deploy import find_tpu_mlir, run_bmodel  # noqa: E402

SEQ, PREFILL, HISTORY = 64, 16, 20
TPU_MASK = np.float32(-10000.0)  # what LLM-TPU's runtime writes into masked attention slots


def tiny_qwen2(directory: Path) -> tuple[int, int, int]:
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from their initial values, so a misread one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return config.hidden_size, config.num_key_value_heads, config.hidden_size // config.num_attention_heads


def block_feeds(h: int, kvh: int, d: int) -> dict[str, tuple[list[np.ndarray], dict[str, np.ndarray]]]:
    """(emulator inputs, bmodel inputs by name) for block_0 and block_cache_0."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, PREFILL, h)).astype(np.float32)
    token = rng.standard_normal((1, 1, h)).astype(np.float32)
    history = np.zeros((2, 1, SEQ, kvh, d), np.float32)
    history[:, :, :HISTORY] = rng.standard_normal((2, 1, HISTORY, kvh, d)).astype(np.float32)
    causal = np.triu(np.full((PREFILL, PREFILL), TPU_MASK, np.float32), 1)[None, None]
    pos = np.arange(PREFILL, dtype=np.int32)[None]
    decode_mask = np.zeros((1, 1, 1, SEQ + 1), np.float32)
    decode_mask[..., HISTORY:SEQ] = -np.inf
    pos_1 = np.array([[HISTORY]], np.int32)
    return {
        "block_0": ([hidden, pos], {"input_states": hidden, "position_ids": pos, "attention_mask": causal}),
        "block_cache_0": ([token, pos_1, decode_mask, history[0], history[1]],
                          {"input_states": token, "position_ids": pos_1,
                           "attention_mask": np.where(np.isinf(decode_mask), TPU_MASK, decode_mask),
                           "history_k": history[0], "history_v": history[1]}),
    }


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu-mlir", required=True, help="python of a venv set up with TOPQ_TPU_MLIR_LLM_CONVERT=1")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    tpu = find_tpu_mlir(args.tpu_mlir)
    if tpu is None:
        raise SystemExit(f"error: no TPU-MLIR at {args.tpu_mlir}")
    bin_dir = Path(args.tpu_mlir).parent
    work = args.workdir or Path(tempfile.mkdtemp(prefix="topq-llmc-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "qwen2"
    h, kvh, d = tiny_qwen2(checkpoint)
    (work / "calib.ids").write_text(" ".join(map(str, np.random.default_rng(0).integers(3, 250, 400))))
    bundle_path = work / "gptq.topq"
    recipe = recipe_from_defaults(
        model={"path": str(checkpoint)}, target={"chip": "bm1684x"}, output={"path": str(bundle_path)},
        quant={"scheme": "gptq", "group_size": 32, "symmetric": False,
               "calibration": {"data": str(work / "calib.ids"), "samples": 4, "seq_len": 32}},
        stages={"seq_length": SEQ, "max_input_length": PREFILL})
    convert(recipe, progress=False)

    started = time.perf_counter()
    assert topq_main(["export", "gptq", str(bundle_path), str(work / "hf_gptq"), "--json"]) == 0
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # its tasks call model_deploy.py
    done = subprocess.run([str(bin_dir / "llm_convert.py"), "-m", str(work / "hf_gptq"), "-s", str(SEQ),
                           "--max_input_length", str(PREFILL), "-q", "w4bf16", "-g", "32", "-c", "bm1684x",
                           "-o", str(work / "llm_convert")], env=env, capture_output=True, text=True, check=False)
    llmc_seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit("error: llm_convert.py failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
    started = time.perf_counter()
    assert topq_main(["export", "tpu-mlir", str(bundle_path), str(work / "topq_tpu"), "--tpu-mlir", args.tpu_mlir,
                      "--option", "nets=block_0,block_cache_0", "--option", "combine=false", "--json"]) == 0
    topq_seconds = time.perf_counter() - started

    llmc_dir = Path(glob.glob(str(work / "llm_convert" / "*_static"))[0])
    emulator = get_plugins().targets.get("bm1684x").open(Bundle(bundle_path))
    print(f"\nwork directory {work}")
    print(f"export gptq + llm_convert.py (all nets): {llmc_seconds:.1f} s; "
          f"topq export tpu-mlir (2 block nets): {topq_seconds:.1f} s\n")
    print(f"{'net':<14} {'output':<14} {'bit-identical':>13} {'cos llm_convert/emu':>20} {'cos topq/emu':>13}")
    for net, (emu_inputs, tpu_inputs) in block_feeds(h, kvh, d).items():
        want = dict(zip(("output_states", "k_cache", "v_cache"), emulator.run(net, emu_inputs)))
        ours = run_bmodel(tpu, work / "topq_tpu" / net / f"{net}.bmodel", tpu_inputs, work / "run_topq" / net)
        theirs = run_bmodel(tpu, llmc_dir / net / f"{net}.bmodel", tpu_inputs, work / "run_llmc" / net)
        for name, expected in want.items():
            expected = np.asarray(expected, np.float32)
            print(f"{net:<14} {name:<14} {str(np.array_equal(ours[name], theirs[name])):>13} "
                  f"{cosine(theirs[name], expected):>20.6f} {cosine(ours[name], expected):>13.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
