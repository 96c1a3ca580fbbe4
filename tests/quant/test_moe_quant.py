"""Per-expert quantization of a mixture-of-experts model (top.MoE): every scheme quantizes each expert's linears;
GPTQ / AWQ calibrate each expert on the tokens routed to it, report the coverage and round to nearest an expert
with too few tokens (here one no token is ever routed to)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from tiny_models import build_unrouted_moe, prompt

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.core.inspect import describe, format_description
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults
from topq.core.runtime import Session

SAMPLES, SEQ_LEN, TOP_K, EXPERTS, LAYERS = 4, 32, 2, 5, 2
EXPERT_ROLES = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe_quant")
    build_unrouted_moe(root / "model")
    ids = root / "calibration.ids"
    ids.write_text(" ".join(map(str, prompt(SAMPLES * SEQ_LEN * 4, seed=20))))
    state: dict[str, Any] = {"root": root, "ids": ids, "eval": prompt(48, seed=21)}
    state["float"] = convert_and_run(state, "f32")[0]
    return state


def convert_and_run(state: dict[str, Any], scheme: str, **quant: Any) -> tuple[np.ndarray, list[dict[str, Any]]]:
    out = state["root"] / f"{scheme}_{'_'.join(f'{k}{v}' for k, v in sorted(quant.items()))}.topq"
    recipe = recipe_from_defaults(
        model={"path": str(state["root"] / "model")},
        quant={"scheme": scheme, "group_size": 32, **quant,
               "calibration": {"data": str(state["ids"]), "samples": SAMPLES, "seq_len": SEQ_LEN}},
        target={"chip": "host"}, stages={"seq_length": 64, "max_input_length": 64, "prefill_kv": False},
        output={"path": str(out)})
    convert(recipe, progress=False)
    bundle = Bundle(out)
    state["last"] = bundle
    return Session(bundle).feed(state["eval"], all_logits=True), list(bundle.meta.get("quant_report") or [])


def expert_name(layer: int, expert: int, role: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{role}.weight"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# End to end on random token ids: GPTQ and AutoRound beat RTN; AWQ (which, the routed experts' input feeding the
# router too, can only clip them, not scale) is on par — its per-linear errors are checked against RTN's above.
@pytest.mark.parametrize("scheme, quant, margin", [("gptq", {}, 1.0), ("awq", {}, 1.1),
                                                    ("autoround", {"iters": 20}, 1.0)])
def test_calibrated_schemes_report_expert_coverage_and_fall_back(moe: dict[str, Any], scheme: str,
                                                                  quant: dict[str, Any], margin: float) -> None:
    logits, report = convert_and_run(moe, scheme, **quant)
    rows = {row["name"]: row for row in report}
    for layer in range(LAYERS):
        tokens = [rows[expert_name(layer, e, "gate_proj")]["tokens"] for e in range(EXPERTS)]
        # every token goes to TOP_K experts, and the router never picks the last one
        assert sum(tokens) == TOP_K * SAMPLES * SEQ_LEN and tokens[-1] == 0 and min(tokens[:-1]) > 0, tokens
        for e in range(EXPERTS):
            for role in EXPERT_ROLES:
                row = rows[expert_name(layer, e, role)]
                assert row["expert"] == e and row["tokens"] == tokens[e]
                if e == EXPERTS - 1:
                    assert row["mode"] == "rtn" and "0 calibration tokens routed to expert 4" in row["fallback"]
                    assert row["error"] is None
                else:
                    assert "fallback" not in row and row["error"] > 0
                    assert row["ratio"] <= 1.0 + 1e-9, row  # the solver does no worse than RTN on its tokens
    text = format_description(describe(moe["last"]))  # `topq inspect`: the fallback's mode, no error to show
    assert re.search(rf"{re.escape(expert_name(0, EXPERTS - 1, 'down_proj'))} +rtn +- ", text), text
    rtn, _ = convert_and_run(moe, "autoround", iters=0)  # zero steps = min/max round-to-nearest
    assert rel(rtn, moe["float"]) > 0.01
    assert rel(logits, moe["float"]) < margin * rel(rtn, moe["float"])


def test_threshold_sends_every_expert_to_rtn(moe: dict[str, Any]) -> None:
    _, report = convert_and_run(moe, "gptq", expert_min_tokens=10**6)
    experts = [row for row in report if "expert" in row]
    assert len(experts) == LAYERS * EXPERTS * len(EXPERT_ROLES)
    assert all(row["mode"] == "rtn" and "fewer than 1000000" in row["fallback"] for row in experts)
    assert "rtn" not in {row.get("mode") for row in report if "expert" not in row}


def test_rtn_quantizes_every_expert(moe: dict[str, Any]) -> None:
    logits, report = convert_and_run(moe, "w4bf16")
    names = {row["name"] for row in report}
    assert {expert_name(layer, e, role) for layer in range(LAYERS) for e in range(EXPERTS)
            for role in EXPERT_ROLES} <= names
    assert rel(logits, moe["float"]) > 0.01  # the experts' weights really are 4-bit


def test_int8_refuses_experts(moe: dict[str, Any]) -> None:
    with pytest.raises(TopqError, match="int8 does not support mixture-of-experts"):
        convert_and_run(moe, "int8")


def test_threshold_below_one_is_refused(moe: dict[str, Any]) -> None:
    with pytest.raises(TopqError, match="expert_min_tokens"):
        convert_and_run(moe, "gptq", expert_min_tokens=0)


def test_forked_pool_gives_the_same_bundle(moe: dict[str, Any], tmp_path: Any) -> None:
    """The batched expert captures (every expert of a layer in one pass) travel through a forked pool's tasks
    and give the same bytes as this process."""
    out = tmp_path / "gptq.topq"
    recipe = recipe_from_defaults(
        model={"path": str(moe["root"] / "model")},
        quant={"scheme": "gptq", "group_size": 32,
               "calibration": {"data": str(moe["ids"]), "samples": SAMPLES, "seq_len": SEQ_LEN}},
        target={"chip": "host"}, stages={"seq_length": 64, "max_input_length": 64, "prefill_kv": False},
        output={"path": str(out)})
    contents = []
    for jobs in (1, 2):
        assert convert(recipe, progress=False, jobs=jobs)["executor"] == ("inline" if jobs == 1 else "local")
        contents.append(out.read_bytes())
    assert contents[0] == contents[1]
