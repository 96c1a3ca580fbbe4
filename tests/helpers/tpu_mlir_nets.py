"""What the TPU-MLIR export tests share: their recipes, the TPU-MLIR installation, and the inputs that make topq's
emulator and TPU-MLIR's simulator (model_runner.py) compute the same block nets."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from topq.plugins.exporters.tpu_mlir.deploy import TpuMlir, find_tpu_mlir

REPO = Path(__file__).resolve().parents[2]
STAGES: dict[str, Any] = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [32], "prefill_kv": True}
S, L, H, HISTORY = STAGES["seq_length"], STAGES["max_input_length"], 64, 20
TPU_MASK = np.float32(-10000.0)  # what LLM-TPU's runtime writes into masked attention slots
OUTPUTS = ("output_states", "k_cache", "v_cache")  # a block net's outputs, in topq's order

Feeds = dict[str, tuple[list[np.ndarray], dict[str, np.ndarray]]]


def write_recipe(directory: Path, checkpoint: Path, scheme: str = "bf16", chip: str = "bm1684x",
                 quant: dict[str, Any] | None = None) -> Path:
    recipe = {"model": {"path": str(checkpoint)}, "quant": {"scheme": scheme, **(quant or {})},
              "target": {"chip": chip},
              "stages": STAGES, "output": {"path": str(directory / f"{scheme}.topq")}}
    path = directory / f"{scheme}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def has_llm_convert_deps(python: str) -> bool:
    """Whether the venv has what llm_convert.py imports beyond the deploy tools (looked up, not imported: importing
    torch costs seconds; scripts/setup-tpu-mlir.sh checks that the tool starts)."""
    probe = "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'transformers'))))"
    return subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0


def tpu_mlir_installation(llm_convert: bool = False) -> TpuMlir:
    """The installation $TOPQ_TPU_MLIR names, else the one scripts/setup-tpu-mlir.sh makes (as scripts/test.sh
    does, so CI covers these tests); about a second when it is already set up. With `llm_convert`, a venv without
    what llm_convert.py needs gets it from the same script (TOPQ_TPU_MLIR_LLM_CONVERT=1)."""
    python = os.environ.get("TOPQ_TPU_MLIR")
    if not python or (llm_convert and not has_llm_convert_deps(python)):
        venv = [str(Path(python).absolute().parent.parent)] if python else []
        env = {**os.environ, **({"TOPQ_TPU_MLIR_LLM_CONVERT": "1"} if llm_convert else {})}
        done = subprocess.run(["bash", str(REPO / "scripts" / "setup-tpu-mlir.sh"), *venv], env=env,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        python = done.stdout.strip().splitlines()[-1]
    found = find_tpu_mlir(python)
    assert found is not None
    return found


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def block_inputs(kvh: int, d: int, seed: int = 0) -> Feeds:
    """Per layer-0 block net: (topq emulator inputs, TPU-MLIR inputs by name) for the same computation."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((1, L, H)).astype(np.float32)
    token = rng.standard_normal((1, 1, H)).astype(np.float32)
    history = np.zeros((2, 1, S, kvh, d), np.float32)
    history[:, :, :HISTORY] = rng.standard_normal((2, 1, HISTORY, kvh, d)).astype(np.float32)
    hk, hv = history

    causal = np.triu(np.full((L, L), TPU_MASK, np.float32), 1)[None, None]
    pos = np.arange(L, dtype=np.int32)[None]
    nets: Feeds = {"block_0": ([hidden, pos], {"input_states": hidden, "position_ids": pos,
                                               "attention_mask": causal})}
    # prefill with history: topq takes a key mask [1,1,1,S+L], TPU-MLIR the full [1,1,L,S+L]
    key_mask = np.zeros((1, 1, 1, S + L), np.float32)
    key_mask[..., HISTORY:S] = -np.inf
    full = np.zeros((1, 1, L, S + L), np.float32)
    full[..., HISTORY:S] = TPU_MASK
    full[..., S:] = causal
    pos_kv = (HISTORY + np.arange(L, dtype=np.int32))[None]
    nets["block_kv_0"] = ([hidden, pos_kv, key_mask, hk, hv],
                          {"input_states": hidden, "position_ids": pos_kv, "attention_mask": full, "history_k": hk,
                           "history_v": hv})
    decode_mask = np.zeros((1, 1, 1, S + 1), np.float32)
    decode_mask[..., HISTORY:S] = -np.inf
    pos_1 = np.array([[HISTORY]], np.int32)
    nets["block_cache_0"] = ([token, pos_1, decode_mask, hk, hv],
                             {"input_states": token, "position_ids": pos_1,
                              "attention_mask": np.where(np.isinf(decode_mask), TPU_MASK, decode_mask),
                              "history_k": hk, "history_v": hv})
    return nets
