"""What a scheme's calibration hands to the pipeline (`CalibrationResult`), and its file form for workers.

The type is part of the core contract: the pipeline reads its fields to install rewritten float tensors, fill the
bundle's quant report and hand the result to workers; the calibration machinery that fills it is in
`topq.quant.calibration` (and re-exports it there).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from topq.core.errors import TopqError
from topq.core.quant import QuantizedWeight
from topq.io.safetensors import SafetensorsFile, write_safetensors

__all__ = ["CalibrationResult", "load_calibration", "save_calibration"]


class CalibrationResult(dict[str, QuantizedWeight]):
    """{linear weight name: QuantizedWeight} (what `QuantScheme.calibrate` returns), plus:

    * `float_weights`: {name: float32 array} — non-quantized tensors the algorithm rewrote (AWQ folds its
      per-channel scales into the RMSNorm weights and into biases); they replace the checkpoint's tensors.
    * `report`: per linear, the calibration-set output error of plain RTN and of the algorithm.
    * `state`: anything else (JSON-able) a scheme's `restore` needs to redo its other changes to the model in a
      worker that loads this result instead of calibrating (int8: the plan).
    * `warnings`: lines the converting process prints (`warning: ...`) once the conversion is known to go ahead
      (after the target compiled it), so a refused recipe still ends in its one error line. Not stored for workers.
    """

    def __init__(self, values: Mapping[str, QuantizedWeight] | None = None) -> None:
        super().__init__(values or {})
        self.float_weights: dict[str, np.ndarray] = {}
        self.report: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.warnings: list[str] = []

    @classmethod
    def of(cls, values: Mapping[str, QuantizedWeight]) -> CalibrationResult:
        """`values` as a CalibrationResult: itself when it is one, else its weights with empty extras (a scheme's
        calibrate may return a plain mapping)."""
        return values if isinstance(values, CalibrationResult) else cls(values)

    @property
    def empty(self) -> bool:
        """Nothing to hand on: no values, no rewritten tensors, no report, no state."""
        return not self and not self.float_weights and not self.report and not self.state


_STORE_KEY = "topq_calibration"
_STORE_FORMAT = 1


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def save_calibration(result: Mapping[str, QuantizedWeight], path: str | Path) -> None:
    """Store a calibration result — quantized values, `float_weights`, `report`, `state` — in one safetensors file
    (arrays exactly as they are, the rest as JSON in its metadata), atomically. No pickle."""
    result = CalibrationResult.of(result)
    tensors: list[tuple[str, np.ndarray]] = []
    quantized: dict[str, dict[str, Any]] = {}
    for name, qw in result.items():
        tensors += [(f"q:{name}:codes", np.ascontiguousarray(qw.codes)),
                    (f"q:{name}:scales", np.ascontiguousarray(qw.scales)),
                    (f"q:{name}:zeros", np.ascontiguousarray(qw.zeros))]
        if qw.g_idx is not None:
            tensors.append((f"q:{name}:g_idx", np.ascontiguousarray(qw.g_idx)))
        quantized[name] = {"bits": int(qw.bits), "group_size": int(qw.group_size), "symmetric": bool(qw.symmetric),
                           "g_idx": qw.g_idx is not None}
    floats = dict(result.float_weights)
    tensors += [(f"f:{name}", np.ascontiguousarray(array)) for name, array in floats.items()]
    doc = {"format": _STORE_FORMAT, "quantized": quantized, "float_weights": list(floats),
           "report": list(result.report), "state": dict(result.state)}
    write_safetensors(path, tensors, {_STORE_KEY: json.dumps(doc, default=_json_default)})


def load_calibration(path: str | Path) -> CalibrationResult:
    """The result `save_calibration` stored (arrays are private copies, identical to the saved ones)."""
    file = SafetensorsFile(path)
    try:
        doc = json.loads(file.metadata[_STORE_KEY])
        if doc.get("format") != _STORE_FORMAT:
            raise ValueError(f"format {doc.get('format')}")
        result = CalibrationResult()
        for name, info in doc["quantized"].items():
            g_idx = file.read(f"q:{name}:g_idx") if info["g_idx"] else None
            result[name] = QuantizedWeight(file.read(f"q:{name}:codes"), file.read(f"q:{name}:scales"),
                                           file.read(f"q:{name}:zeros"), int(info["bits"]), int(info["group_size"]),
                                           bool(info["symmetric"]), g_idx)
        for name in doc["float_weights"]:
            result.float_weights[name] = file.read(f"f:{name}")
        result.report = list(doc["report"])
        result.state = dict(doc["state"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TopqError(f"{path}: not a topq calibration file ({type(exc).__name__}: {exc})") from None
    return result
