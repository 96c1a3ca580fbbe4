"""Describe a bundle for `topq inspect`: stages, function signatures, tensor sizes, and target reports."""

from __future__ import annotations

from typing import Any

from topq.core.bundle import Bundle
from topq.core.plugins import get_plugins
from topq.ir.parser import parse_module


def describe(bundle: Bundle) -> dict[str, Any]:
    module = parse_module(bundle.program, source=f"{bundle.path}:program")
    functions = [
        {"name": f.name, "inputs": [str(t) for t in f.input_types], "outputs": [str(t) for t in f.result_types],
         "ops": sum(1 for _ in f.walk())}
        for f in module
    ]
    sizes = {name: int(bundle.tensor(name).nbytes) for name in bundle.tensor_names()}
    info: dict[str, Any] = {
        "path": str(bundle.path),
        "target": bundle.target,
        "scheme": bundle.meta.get("scheme"),
        "family": bundle.meta.get("family"),
        "spec": bundle.meta["spec"],
        "stages": bundle.meta["stages"],
        "functions": functions,
        "tensors": len(sizes),
        "tensor_bytes": sum(sizes.values()),
        "file_bytes": bundle.path.stat().st_size,
        "quant_report": bundle.meta.get("quant_report") or [],
    }
    target = get_plugins().targets.get(bundle.target)
    if target.report is not None:
        info.update(target.report(bundle))
    return info


def format_description(info: dict[str, Any]) -> str:
    spec, stages = info["spec"], info["stages"]
    lines = [
        f"bundle   {info['path']} ({info['file_bytes'] / 1e6:.1f} MB)",
        f"target   {info['target']}   scheme {info['scheme']}   family {info['family']} ({spec['architecture']})",
        f"model    {spec['num_layers']} layers, hidden {spec['hidden_size']}, heads {spec['num_heads']}/"
        f"{spec['num_kv_heads']} (head dim {spec['head_dim']}), vocab {spec['vocab_size']}",
        f"stages   seq_length {stages['seq_length']}, max_input_length {stages['max_input_length']}, "
        f"prefill_kv {stages['prefill_kv']}, decode variants {stages['decode_variants']}",
        f"weights  {info['tensors']} tensors, {info['tensor_bytes'] / 1e6:.1f} MB",
        "",
        f"{'function':<24} {'ops':>5}  signature",
    ]
    for f in info["functions"]:
        lines.append(f"{f['name']:<24} {f['ops']:>5}  ({', '.join(f['inputs'])}) -> ({', '.join(f['outputs'])})")
    if info["quant_report"]:
        lines += ["", f"{'quantized linear':<48} {'mode':>6} {'output error':>12} {'RTN error':>12} {'ratio':>7}"]
        for row in info["quant_report"]:
            lines.append(f"{row['name']:<48} {row.get('mode', '-'):>6} {_number(row.get('error'), '12.3e')} "
                         f"{_number(row.get('rtn_error'), '12.3e')} {_number(row.get('ratio'), '7.3f')}")
    for section in info.get("text_sections", []):
        lines += ["", section]
    return "\n".join(lines)


def _number(value: float | None, fmt: str) -> str:
    """A report cell: the formatted number, or "-" right-aligned when the scheme has no such column."""
    width = int(fmt.split(".")[0])
    return f"{value:{fmt}}" if value is not None else f"{'-':>{width}}"
