"""Exporter `onnx-genai`: an onnx bundle as a folder onnxruntime-genai runs as is.

`topq export onnx-genai BUNDLE DIR` writes `model.onnx` (+ `model.onnx.data`, its initializers), a decoder with
`past_key_values.<i>.key/value` in and `present.<i>.key/value` out (decoder.py), `genai_config.json` in the
format of onnxruntime-genai's model builder, and the bundle's tokenizer files. The bundle must be compiled for
`target.chip: onnx`: its MatMulNBits tensors are what the decoder multiplies by, so GPTQ / AWQ / AutoRound values
reach onnxruntime-genai unchanged. DIR is written atomically (a sibling temporary folder renamed into place) and
must not exist or be empty. No options. See docs/onnx.md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import topq
from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.exporter import Exporter, ExportRequest
from topq.core.hookspecs import Register

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "genai_config.json"


def genai_config(bundle: Bundle, head_size: int) -> dict[str, Any]:
    """genai_config.json as onnxruntime-genai's model builder writes it for a CPU decoder (greedy search)."""
    spec = bundle.meta["spec"]
    context = int(bundle.meta["stages"]["seq_length"])  # the RoPE tables hold this many positions
    architecture = str(spec.get("architecture") or spec["family"])
    model_type = architecture[:architecture.find("For")] if "For" in architecture else architecture
    eos = [int(t) for t in spec.get("eos_token_ids") or []]
    return {
        "model": {
            "bos_token_id": spec.get("bos_token_id"),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": head_size,
                "hidden_size": int(spec["hidden_size"]),
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": int(spec["num_heads"]),
                "num_hidden_layers": int(spec["num_layers"]),
                "num_key_value_heads": int(spec["num_kv_heads"]),
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": spec.get("pad_token_id", eos[0] if eos else 0),
            "type": model_type.lower(),
            "vocab_size": int(spec["vocab_size"]),
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def open_onnx_bundle(path: Path) -> Bundle:
    bundle = Bundle(path)
    if bundle.target != "onnx":
        raise TopqError(f"onnx-genai: {path} was compiled for {bundle.target}; export a bundle converted with "
                        f"target.chip: onnx")
    return bundle


def export(request: ExportRequest) -> dict[str, Any]:
    if request.options:
        raise TopqError(f"exporter onnx-genai: unknown option {sorted(request.options)[0]!r} (it has no options)")
    if request.tool is not None:
        raise TopqError("exporter onnx-genai: --tool does not apply (onnxruntime-genai loads the folder itself)")
    out_dir = request.out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise TopqError(f"onnx-genai: {out_dir} exists and is not an empty directory")
    bundle = open_onnx_bundle(request.source)
    import onnx
    from onnx import numpy_helper

    from topq.plugins.exporters.onnx_genai.decoder import build_decoder
    from topq.plugins.targets.onnx.lowering import check_model

    model, values = build_decoder(bundle)
    check_model(model)
    constants = [t for t in model.graph.initializer if t.name not in values]
    del model.graph.initializer[:]
    model.graph.initializer.extend(constants + [numpy_helper.from_array(array, name) for name, array in values.items()])
    head_size = int(model.graph.input[3].type.tensor_type.shape.dim[3].dim_value)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        onnx.save_model(model, tmp / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)  # shape constants stay in the graph
        (tmp / CONFIG_FILE).write_text(json.dumps(genai_config(bundle, head_size), indent=2) + "\n")
        tokenizer = bundle.meta.get("tokenizer") or {}
        for name, text in tokenizer.items():
            (tmp / Path(name).name).write_text(text)
        mode = 0o777 & ~_umask()
        tmp.chmod(mode)  # mkdtemp makes it private; the folder is the user's output like any other
        for path in tmp.iterdir():
            path.chmod(mode & 0o666)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out_dir.iterdir())
    return {"output": str(out_dir), "files": files, "matmul_nbits": sum(n.op_type == "MatMulNBits"
                                                                       for n in model.graph.node)}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


EXPORTER = Exporter(name="onnx-genai", description="onnx bundle → model.onnx + genai_config.json for "
                                                   "onnxruntime-genai (decoder with past_key_values / present)",
                    export=export)


@topq.hookimpl
def register_exporters(register: Register[Exporter]) -> None:
    register(EXPORTER)
