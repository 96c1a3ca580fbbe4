"""CalibrationResult is a core contract type: its extras are declared fields, a plain mapping from a scheme's
calibrate is taken as a result with empty extras, and the file form keeps everything."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import topq.quant.calibration as quant_calibration
from topq.core.calibration_result import CalibrationResult, load_calibration, save_calibration
from topq.core.quant import QuantizedWeight


def _weight() -> QuantizedWeight:
    codes = np.array([[1, 2, 3, 4]], dtype=np.uint8)
    return QuantizedWeight(codes, np.ones((1, 1), np.float32), np.full((1, 1), 2, np.uint8), 4, 4, False)


def test_the_quant_layer_re_exports_the_core_type() -> None:
    assert quant_calibration.CalibrationResult is CalibrationResult
    assert quant_calibration.save_calibration is save_calibration
    assert quant_calibration.load_calibration is load_calibration


def test_a_plain_mapping_becomes_a_result_with_empty_extras() -> None:
    plain = {"w": _weight()}
    result = CalibrationResult.of(plain)
    assert isinstance(result, CalibrationResult) and list(result) == ["w"]
    assert (result.float_weights, result.report, result.state) == ({}, [], {})
    assert not result.empty
    same = CalibrationResult()
    assert CalibrationResult.of(same) is same and same.empty
    same.report.append({"name": "w", "error": 0.5})
    assert not same.empty


def test_save_and_load_keep_values_and_extras(tmp_path: Path) -> None:
    result = CalibrationResult({"w": _weight()})
    result.float_weights["n"] = np.array([0.5, 1.5], np.float32)
    result.report.append({"name": "w", "error": np.float32(0.25)})
    result.state["plan"] = {"w": "int8"}
    save_calibration(result, tmp_path / "c.safetensors")
    loaded = load_calibration(tmp_path / "c.safetensors")
    assert np.array_equal(loaded["w"].codes, result["w"].codes) and loaded["w"].bits == 4
    assert np.array_equal(loaded.float_weights["n"], result.float_weights["n"])
    assert loaded.report == [{"name": "w", "error": 0.25}] and loaded.state == {"plan": {"w": "int8"}}
    save_calibration({"w": _weight()}, tmp_path / "plain.safetensors")  # a scheme's plain mapping stores too
    assert load_calibration(tmp_path / "plain.safetensors").report == []
