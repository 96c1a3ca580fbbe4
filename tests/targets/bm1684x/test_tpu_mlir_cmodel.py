"""With TPU-MLIR installed: exported nets compile with model_deploy.py and, run on TPU-MLIR's simulator
(model_runner.py, cmodel), give what topq's bm1684x emulator gives for the same function and inputs.

The installation comes from $TOPQ_TPU_MLIR or is made by scripts/setup-tpu-mlir.sh (which scripts/test.sh
runs first, so CI covers this); about a second when it is already set up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tpu_mlir_nets import OUTPUTS, TPU_MASK, L, S, block_inputs, cosine, tpu_mlir_installation, write_recipe

from topq.core.bundle import Bundle
from topq.core.cli import main
from topq.core.errors import TopqError
from topq.core.pipeline import convert
from topq.core.plugins import get_plugins
from topq.core.recipe import load_recipe
from topq.plugins.exporters.tpu_mlir.deploy import TpuMlir, run_bmodel, run_tool


@pytest.fixture(scope="session")
def tpu_mlir() -> TpuMlir:
    return tpu_mlir_installation()


def export_and_compare(tpu: TpuMlir, root: Path, kind: str, scheme: str, threshold: float, route: str = "float",
                       quant: dict[str, Any] | None = None) -> dict[str, float]:
    """Convert a tiny `kind` to a bm1684x `scheme` bundle, export + compile its block nets, compare on cmodel."""
    from tiny_models import build_tiny

    model = build_tiny(kind, root / "model", overrides={"num_hidden_layers": 1})
    if quant and "calibration" in quant:
        ids = np.random.default_rng(0).integers(3, 250, 400)
        (root / "calib.ids").write_text(" ".join(map(str, ids)), encoding="utf-8")
        quant = {**quant, "calibration": {**quant["calibration"], "data": str(root / "calib.ids")}}
    recipe_path = write_recipe(root, root / "model", scheme=scheme, quant=quant)
    convert(load_recipe(recipe_path), progress=False)
    bundle = Bundle(root / f"{scheme}.topq")
    out = root / "export"
    nets = ["block_0", "block_kv_0", "block_cache_0"]
    assert main(["export", "tpu-mlir", str(bundle.path), str(out), "--tpu-mlir", str(tpu.python),
                 "--option", f"nets={','.join(nets)}",
                 "--option", "combine=false", "--option", f"route={route}", "--jobs", "2", "--json"]) == 0
    if route == "prequantized":  # every block linear carries topq's codes
        text = (out / "block_0" / "block_0.mlir").read_text(encoding="utf-8")
        assert text.count('"top.A16MatMul"') == 7 and '"top.MatMul"' not in text
    emulator = get_plugins().targets.get("bm1684x").open(bundle)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cosines: dict[str, float] = {}
    for net, (topq_inputs, tpu_inputs) in block_inputs(config.num_key_value_heads, head_dim).items():
        expected = emulator.run(net, topq_inputs)
        got = run_bmodel(tpu, out / net / f"{net}.bmodel", tpu_inputs, out / net)
        for name, want in zip(OUTPUTS, expected):
            assert got[name].shape == np.asarray(want).shape, (net, name)
            cosines[f"{net}.{name}"] = cosine(got[name], np.asarray(want, np.float32))
    worst = min(cosines, key=cosines.__getitem__)
    print(f"{kind} {scheme} {route}: " + ", ".join(f"{k} {v:.6f}" for k, v in sorted(cosines.items())))
    assert cosines[worst] >= threshold, f"{kind} {scheme}: {worst} cosine {cosines[worst]:.6f} < {threshold}"
    return cosines


@pytest.mark.parametrize(("kind", "scheme", "threshold"), [
    ("qwen2", "bf16", 0.9999),
    ("llama", "bf16", 0.9999),
    ("qwen3", "bf16", 0.9999),
    ("qwen2", "w8bf16", 0.9999),
    ("qwen2", "w4bf16", 0.999),
])
def test_blocks_on_cmodel_match_the_emulator(tpu_mlir: TpuMlir, tmp_path: Path, kind: str, scheme: str,
                                             threshold: float) -> None:
    export_and_compare(tpu_mlir, tmp_path, kind, scheme, threshold)


@pytest.mark.parametrize(("kind", "scheme", "quant"), [
    ("qwen2", "w4bf16", {"group_size": 32}),
    ("llama", "gptq", {"group_size": 32, "calibration": {"samples": 4, "seq_len": 32}}),
    ("qwen2", "awq", {"group_size": 32, "calibration": {"samples": 4, "seq_len": 32}}),
])
def test_prequantized_blocks_on_cmodel_match_the_emulator(tpu_mlir: TpuMlir, tmp_path: Path, kind: str, scheme: str,
                                                          quant: dict[str, Any]) -> None:
    """The pre-quantized route: A16MatMul with topq's own codes (RTN, GPTQ, AWQ with its rescaled norms),
    W4 threshold 0.999."""
    export_and_compare(tpu_mlir, tmp_path, kind, scheme, 0.999, route="prequantized", quant=quant)


def test_tool_failure_is_one_error_with_the_log_tail(tpu_mlir: TpuMlir, tmp_path: Path) -> None:
    (tmp_path / "broken.mlir").write_text('module @"broken" {\n  this is not mlir\n}\n', encoding="utf-8")
    with pytest.raises(TopqError) as info:
        run_tool(tpu_mlir, "model_deploy.py", ["--mlir", "broken.mlir", "--quantize", "BF16", "--chip", "bm1684x",
                                               "--model", "broken.bmodel"], tmp_path, "deploy.log")
    message = str(info.value)
    assert "TPU-MLIR model_deploy.py failed" in message and "deploy.log" in message
    assert "Traceback" not in message.split(":", 1)[0]
    assert len(message.splitlines()) == 1


def chained_greedy(tpu: TpuMlir, out: Path, prompt: list[int], steps: int, kvh: int, d: int) -> list[int]:
    """Greedy generation by running the exported nets one by one on cmodel, as LLM-TPU's runtime chains them."""
    def run(net: str, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        return run_bmodel(tpu, out / net / f"{net}.bmodel", inputs, out / net / "chain")

    def only(outputs: dict[str, np.ndarray]) -> np.ndarray:
        # a net compiled without --quant_output (lm_head) names its output NAME_f32
        (value,) = outputs.values()
        return value

    n = len(prompt)
    ids = np.zeros((1, L), np.int32)
    ids[0, :n] = prompt
    hidden = only(run("embedding", input_ids=ids))
    causal = np.triu(np.full((L, L), TPU_MASK, np.float32), 1)[None, None]
    block = run("block_0", input_states=hidden, position_ids=np.arange(L, dtype=np.int32)[None],
                attention_mask=causal)
    k_cache = np.zeros((1, S, kvh, d), np.float32)
    v_cache = np.zeros((1, S, kvh, d), np.float32)
    k_cache[:, :n], v_cache[:, :n] = block["k_cache"][:, :n], block["v_cache"][:, :n]
    last = block["output_states"][:, n - 1:n]
    tokens: list[int] = []
    for step in range(steps):
        logits = only(run("lm_head", hidden_states=last))
        tokens.append(int(only(run("greedy_head", m_logits=logits.reshape(1, -1))).ravel()[0]))
        if step == steps - 1:
            break
        position = n + step
        token_hidden = only(run("embedding_cache", input_ids=np.array([[tokens[-1]]], np.int32)))
        mask = np.zeros((1, 1, 1, S + 1), np.float32)
        mask[..., position:S] = TPU_MASK
        decoded = run("block_cache_0", input_states=token_hidden, position_ids=np.array([[position]], np.int32),
                      attention_mask=mask, history_k=k_cache, history_v=v_cache)
        k_cache[:, position], v_cache[:, position] = decoded["k_cache"][:, 0], decoded["v_cache"][:, 0]
        last = decoded["output_states"]
    return tokens


def test_greedy_tokens_of_chained_nets_equal_topq_run(tpu_mlir: TpuMlir, tmp_path: Path) -> None:
    from tiny_models import build_tiny

    from topq.core.runtime import Sampling, Session

    model = build_tiny("qwen2", tmp_path / "model", overrides={"num_hidden_layers": 1})
    recipe_path = write_recipe(tmp_path, tmp_path / "model", scheme="bf16")
    convert(load_recipe(recipe_path), progress=False)
    bundle = Bundle(tmp_path / "bf16.topq")
    out = tmp_path / "export"
    assert main(["export", "tpu-mlir", str(recipe_path), str(out), "--tpu-mlir", str(tpu_mlir.python),
                 "--jobs", "2", "--json"]) == 0
    assert (out / "model.bmodel").stat().st_size > sum((out / n / f"{n}.bmodel").stat().st_size
                                                       for n in ("block_0", "lm_head")) // 2
    prompt = [5, 17, 42, 99, 7]
    expected = [t for t, _ in Session(bundle).generate(prompt, 3, Sampling(greedy=True), stop_ids=[])]
    config = model.config
    got = chained_greedy(tpu_mlir, out, prompt, 3, config.num_key_value_heads,
                         config.hidden_size // config.num_attention_heads)
    assert got == expected
