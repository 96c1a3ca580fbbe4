"""Run a bundle's ONNX graphs in ONNX Runtime: one InferenceSession per stage function, created from bytes.

Sessions are created on first use (a conversation touches one decode variant, not all of them), each with at
most `MAX_THREADS` intra-op threads and sequential execution. Initializers come from the bundle's memory-mapped
tensors through `SessionOptions.add_external_initializers` (ORT copies them in before optimizing, so it can
fold the weight transposes and prepack MatMulNBits blocks). The KV cache stays in topq's Session.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

import numpy as np

from topq.core.bundle import Bundle
from topq.core.errors import TopqError
from topq.plugins.targets.onnx.conventions import ONNX_BFLOAT16, PROGRAM_VERSION

MAX_THREADS = 2
#: ONNX ops that compute each position alone (RMSNorm as ORT fuses or decomposes it, matmuls on a weight, the
#: family's elementwise head hook); a Transpose in lm_head is a weight's
POSITION_WISE = frozenset({"SimplifiedLayerNormalization", "LayerNormalization", "Pow", "ReduceMean", "Add", "Sqrt",
                           "Div", "Mul", "MatMul", "MatMulNBits", "Transpose", "Tanh", "Cast", "Constant", "Identity"})
INSTALL_HINT = "pip install 'onnxruntime>=1.20,<2'"


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise TopqError(f"the onnx target needs ONNX Runtime, which is not installed: {INSTALL_HINT}") from None
    return onnxruntime


def threads() -> int:
    """Intra-op threads per session: TOPQ_ONNX_THREADS, at most MAX_THREADS (the machines topq runs on share
    their cores; more threads cost more in waiting than they gain)."""
    wanted = os.environ.get("TOPQ_ONNX_THREADS", str(MAX_THREADS))
    try:
        return max(1, min(MAX_THREADS, int(wanted)))
    except ValueError:
        raise TopqError(f"TOPQ_ONNX_THREADS must be an integer, got {wanted!r}") from None


class OnnxExecutor:
    """The runtime's Executor for an onnx bundle."""

    def __init__(self, bundle: Bundle, accuracy_level: int | None = None) -> None:
        self.ort = import_onnxruntime()
        meta = bundle.meta.get("target_meta") or {}
        if bundle.target != "onnx":
            raise TopqError(f"{bundle.path}: bundle was compiled for {bundle.target}, not onnx")
        if meta.get("program_version") != PROGRAM_VERSION:
            raise TopqError(f"{bundle.path}: onnx program version {meta.get('program_version')} is not the "
                            f"executor's {PROGRAM_VERSION}; convert it again")
        self.bundle = bundle
        self.functions: dict[str, dict[str, Any]] = meta["functions"]
        self.sessions: dict[str, Any] = {}
        self.threads = threads()
        # an accuracy_level other than the compiled one (TOPQ_ONNX_ACCURACY_LEVEL): graphs are edited on load
        self.accuracy_level = None if accuracy_level == meta.get("accuracy_level") else accuracy_level

    @cached_property
    def lm_head_rows(self) -> bool:
        """The runtime's batched logits (`Executor` doc): lm_head also runs on [1, T, H], from a copy of its graph
        whose position axis is symbolic (ONNX Runtime checks inputs against the graph's static shapes); only when
        every node computes each position alone (no reshape fixes the position count)."""
        import onnx

        if "lm_head" not in self.functions:
            return False
        graph = onnx.load_from_string(self.bundle.tensor(self.functions["lm_head"]["graph"]).tobytes()).graph
        return all(node.op_type in POSITION_WISE for node in graph.node)

    def session(self, name: str, any_positions: bool = False) -> Any:
        key = f"{name}[positions]" if any_positions else name
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = self._create(name, any_positions)
        return session

    def _create(self, name: str, any_positions: bool = False) -> Any:
        try:
            entry = self.functions[name]
        except KeyError:
            raise TopqError(f"{self.bundle.path}: no function @{name}; functions: {', '.join(self.functions)}") \
                from None
        ort = self.ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Every function has its own session and thread pool; idle pools that spin-wait take the cores from the one
        # that runs (measured: 3.7 s instead of 0.13 s per SmolLM2 decode step on 2 loaded cores). TOPQ_ONNX_SPIN=1
        # turns spinning back on for a machine of one's own.
        if os.environ.get("TOPQ_ONNX_SPIN") != "1":
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # ORT's warnings about folded initializers are not the user's concern
        names = list(entry["initializers"])
        options.add_external_initializers(names, [self._ort_value(n) for n in names])
        graph = self.bundle.tensor(entry["graph"]).tobytes()
        if self.accuracy_level is not None:
            graph = with_accuracy_level(graph, self.accuracy_level)
        if any_positions:
            graph = with_symbolic_positions(graph)
        try:
            return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT's exception types derive from Exception only
            raise TopqError(f"{self.bundle.path}: ONNX Runtime cannot load @{name}: "
                            f"{str(exc).splitlines()[0]}") from None

    def _ort_value(self, name: str) -> Any:
        array = np.ascontiguousarray(self.bundle.tensor(name))
        if array.dtype.name == "bfloat16":  # numpy has no bfloat16: hand ORT the bits with their ONNX type
            return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), ONNX_BFLOAT16)
        return self.ort.OrtValue.ortvalue_from_numpy(array)

    def run(self, name: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        session = self.session(name, name == "lm_head" and inputs[0].ndim == 3 and inputs[0].shape[1] != 1)
        feeds = {}
        for arg, value in zip(session.get_inputs(), inputs):
            feeds[arg.name] = np.ascontiguousarray(value, dtype=_NP_TYPES.get(arg.type, None))
        return list(session.run(None, feeds))


def with_symbolic_positions(graph: bytes) -> bytes:
    """A position-wise graph ([1, 1, ...] in, [1, 1, ...] out) with axis 1 of its inputs and outputs named
    `positions` instead of 1, and its intermediate shapes dropped (ONNX Runtime infers them again)."""
    import onnx

    model = onnx.load_from_string(graph)
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if len(dims) < 2 or dims[1].dim_value != 1:
            raise TopqError(f"graph input/output {value.name} has no position axis of length 1")
        dims[1].dim_param = "positions"
    del model.graph.value_info[:]
    return bytes(model.SerializeToString())


def with_accuracy_level(graph: bytes, level: int) -> bytes:
    """The graph with every MatMulNBits' accuracy_level set to `level`."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(graph)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("accuracy_level", level)])
    return bytes(model.SerializeToString())


_NP_TYPES: dict[str, Any] = {"tensor(float)": np.float32, "tensor(int32)": np.int32, "tensor(int64)": np.int64}
