"""`topq export onnx-genai BUNDLE DIR`: the decoder it writes computes what the onnx bundle computes, and
onnxruntime-genai generates with the folder as is.

* plain ONNX Runtime on model.onnx (past_key_values.* in, present.* out): the prompt's logits and every decode
  step's, fed back the presents, equal the bundle's Session within 1e-4 (qwen2: biases; qwen3: q/k norms, W4
  MatMulNBits; tied embeddings with a quantized lm_head);
* onnxruntime-genai 0.18 generates the same 16 greedy tokens as `topq run`;
* what it refuses: a bundle for another target, a non-empty output folder, options.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from host_bundles import TinyCheckpoint

from topq.core import cli
from topq.core.bundle import Bundle
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session

STAGES = {"seq_length": 64, "max_input_length": 16}
PROMPT = [5, 9, 77, 120, 3, 44, 200, 17, 8, 61, 250, 33, 90, 14, 101, 66, 7, 150, 42, 23]  # > max_input_length
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_f32": ("qwen2", {"scheme": "f32"}),
    "qwen3_w4_g32": ("qwen3", {"scheme": "w4bf16", "group_size": 32}),
    "tied_w4_lm_head": ("llama_tied", {"scheme": "w4f16", "group_size": 16, "symmetric": True, "lm_head": "w4f16"}),
}


def convert_onnx(tiny_checkpoint: TinyCheckpoint, directory: Path, kind: str, quant: dict[str, Any],
                 chip: str = "onnx") -> Bundle:
    tiny_checkpoint(kind, directory)
    out = directory / f"{chip}.topq"
    convert(recipe_from_defaults(model={"path": str(directory)}, target={"chip": chip}, stages=STAGES,
                                 quant=quant, output={"path": str(out)}), progress=False)
    return Bundle(out)


@pytest.fixture(scope="module")
def exported(tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for case, (kind, quant) in CASES.items():
        directory = tmp_path_factory.mktemp(f"genai_{case}")
        bundle = convert_onnx(tiny_checkpoint, directory, kind, quant)
        assert cli.main(["export", "onnx-genai", str(bundle.path), str(directory / "genai")]) == 0
        out[case] = (bundle, directory / "genai")
    return out


def decoder_inputs(config: dict[str, Any], ids: list[int], start: int, past: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, start + len(ids)), np.int64),
            "position_ids": np.arange(start, start + len(ids), dtype=np.int64)[None], **past}


@pytest.mark.parametrize("case", list(CASES))
def test_the_decoder_computes_what_the_bundle_computes(exported: dict[str, Any], case: str) -> None:
    bundle, folder = exported[case]
    config = json.loads((folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    layers, kv_heads, head = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    session = ort.InferenceSession(str(folder / decoder["filename"]), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    assert [i.name for i in session.get_inputs()][3:] == [f"past_key_values.{i}.{kv}" for i in range(layers)
                                                          for kv in ("key", "value")]
    past = {f"past_key_values.{i}.{kv}": np.zeros((1, kv_heads, 0, head), np.float32)
            for i in range(layers) for kv in ("key", "value")}

    reference = Session(bundle)
    want = reference.feed(PROMPT, all_logits=True)
    logits, *presents = session.run(None, decoder_inputs(config, PROMPT, 0, past))
    assert logits.shape == (1, len(PROMPT), config["model"]["vocab_size"])
    assert float(np.abs(logits[0] - want).max()) <= 1e-4
    length = len(PROMPT)
    for _ in range(6):  # greedy decode steps on the presents fed back
        token = int(np.argmax(logits[0, -1]))
        want = reference.decode(token)
        past = {n.replace("present", "past_key_values"): p for n, p in zip(names[1:], presents)}
        assert all(p.shape == (1, kv_heads, length, head) for p in past.values())
        logits, *presents = session.run(None, decoder_inputs(config, [token], length, past))
        assert float(np.abs(logits[0, -1] - want).max()) <= 1e-4
        length += 1


def test_onnxruntime_genai_generates_what_topq_run_generates(exported: dict[str, Any],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime_genai as og

    bundle, folder = exported["qwen3_w4_g32"]
    prompt = PROMPT[:9]
    capsys.readouterr()
    assert cli.main(["run", str(bundle.path), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "16",
                     "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert len(want) == 16  # the prompt is chosen so that no end-of-text token comes first

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 16, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    got = []
    while not generator.is_done():
        generator.generate_next_token()
        got.append(int(generator.get_next_tokens()[0]))
    assert got == want


def test_what_the_export_refuses(tiny_checkpoint: TinyCheckpoint, exported: dict[str, Any], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    host = convert_onnx(tiny_checkpoint, tmp_path, "llama", {"scheme": "f32"}, chip="host")
    bundle, folder = exported["qwen2_f32"]
    before = sorted(p.name for p in folder.iterdir())
    for args, message in (
        ([str(host.path), str(tmp_path / "out")], "was compiled for host; export a bundle converted with "
                                                  "target.chip: onnx"),
        ([str(bundle.path), str(folder)], "exists and is not an empty directory"),
        ([str(bundle.path), str(tmp_path / "out"), "--option", "dtype=f16"], "unknown option 'dtype'"),
        ([str(tmp_path / "config.json"), str(tmp_path / "out")], "not a valid topq bundle"),
    ):
        capsys.readouterr()
        assert cli.main(["export", "onnx-genai", *args]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in folder.iterdir()) == before
