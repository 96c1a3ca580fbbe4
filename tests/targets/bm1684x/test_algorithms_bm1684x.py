"""GPTQ, AWQ and AutoRound bundles run on bm1684x: the chip computes what the host computes with the same integers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from host_bundles import TinyCheckpoint

from topq.core.bundle import Bundle
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session

IDS = [1, 5, 9, 77, 120, 3, 44, 200]


@pytest.fixture(scope="module")
def tiny_with_calibration(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    d = tmp_path_factory.mktemp("algo_bm")
    tiny_checkpoint("llama", d)
    ids = np.random.default_rng(0).integers(3, 250, 400)
    (d / "calib.ids").write_text(" ".join(map(str, ids)))
    return d


# act-order GPTQ with static groups has plain groups (no g_idx), which bm1684x stores; permuted ones it refuses
@pytest.mark.parametrize(("scheme", "options"), [("gptq", {}), ("gptq", {"act_order": True, "static_groups": True}),
                                                 ("awq", {}), ("autoround", {})], ids=["gptq", "gptq-static-act-order",
                                                                                      "awq", "autoround"])
def test_algorithm_runs_on_bm1684x_like_host(tiny_with_calibration: Path, scheme: str,
                                             options: dict[str, bool]) -> None:
    d = tiny_with_calibration
    logits = {}
    for chip in ("host", "bm1684x"):
        out = d / f"{scheme}{len(options)}_{chip}.topq"
        recipe = recipe_from_defaults(
            model={"path": str(d)}, target={"chip": chip}, output={"path": str(out)},
            quant={"scheme": scheme, "group_size": 32, "iters": 20, **options,
                   "calibration": {"data": str(d / "calib.ids"), "samples": 4, "seq_len": 32}},
            stages={"seq_length": 64, "max_input_length": 16})
        convert(recipe, progress=False)
        bundle = Bundle(out)
        logits[chip] = Session(bundle).feed(IDS, all_logits=True)
        if chip == "bm1684x":  # the algorithm's weights are stored as packed 4-bit A16 weights
            assert "model.layers.0.mlp.down_proj.weight.packed" in bundle.tensor_names()
    a, b = logits["host"], logits["bm1684x"]
    assert float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.999


def test_awq_folds_its_scales_into_the_bundle_and_reports_errors(tiny_with_calibration: Path) -> None:
    """AWQ rewrites the norms in front of the scaled linears; the bundle must carry those rewritten norms (else the
    model is wrong), be closer to float than RTN, and report each linear's relative output error."""
    d = tiny_with_calibration
    results = {}
    for scheme in ("f32", "w4bf16", "awq"):
        out = d / f"cmp_{scheme}.topq"
        recipe = recipe_from_defaults(
            model={"path": str(d)}, target={"chip": "host"}, output={"path": str(out)},
            quant={"scheme": scheme, "group_size": 32, "symmetric": False,
                   "calibration": {"data": str(d / "calib.ids"), "samples": 4, "seq_len": 32}},
            stages={"seq_length": 64, "max_input_length": 16})
        summary = convert(recipe, progress=False)
        results[scheme] = (Bundle(out), summary)
    logits = {s: Session(b).feed(IDS, all_logits=True) for s, (b, _) in results.items()}
    error = {s: float(np.abs(logits[s] - logits["f32"]).max()) for s in ("w4bf16", "awq")}
    assert error["awq"] < error["w4bf16"], error
    norm = "model.layers.0.input_layernorm.weight"
    assert not np.array_equal(np.asarray(results["awq"][0].tensor(norm)), np.asarray(results["f32"][0].tensor(norm)))
    report = results["awq"][1]["quant_report"]
    assert len(report) == 14 and all(0 < row["error"] < 1 and 0 < row["rtn_error"] < 1 for row in report)
    assert results["awq"][0].meta["quant_report"] == report
