"""Exporter `tpu-mlir`: topq's Top IR as the Top MLIR + weight npz TPU-MLIR compiles into BM1684X bmodels.

`topq export tpu-mlir RECIPE_OR_BUNDLE DIR` writes one directory per net, named as LLM-TPU's runtime expects
(embedding, embedding_cache, block_i, block_kv_i, block_cache_i, lm_head, greedy_head), each with `NAME.mlir`
and `NAME_top_weights.npz`, and `DIR/export.json` (nets, inputs, outputs, the model_deploy arguments). With a
TPU-MLIR installation (`--tpu-mlir PYTHON` or $TOPQ_TPU_MLIR) it also runs model_deploy.py per net in parallel
and `model_tool --combine` into `DIR/model.bmodel`.

Two routes for quantized linears: the float route exports float32 weights and TPU-MLIR quantizes them (RTN)
as `--quantize` asks; the pre-quantized route writes `top.A16MatMul` with topq's own codes, scales and zero
points, so GPTQ / AWQ / AutoRound / imported values reach the chip.

Options (`--option KEY=VALUE`): `quantize` (bf16, f16, w8bf16, w4bf16, w8f16, w4f16; default from the
recipe), `group_size` (default the recipe's `quant.group_size`), `chip` (bm1684x), `combine` (true/false,
default true), `nets` (comma-separated net names to compile; default all; every net's files are written
either way), `route` (float or prequantized; default prequantized for calibrated schemes and `auto`, float
otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import topq
from topq.core.export_source import source_recipe
from topq.core.exporter import Exporter, ExportRequest
from topq.core.hookspecs import Register
from topq.core.quant import QuantScheme
from topq.ir.errors import TopqError
from topq.ir.graph import Function, Module
from topq.plugins.exporters.tpu_mlir.deploy import TpuMlir, combine, deploy_all, find_tpu_mlir
from topq.plugins.exporters.tpu_mlir.translate import (
    Net,
    QuantizedGetter,
    WeightGetter,
    greedy_head,
    translate_function,
)

QUANTIZE_MODES = ("f32", "bf16", "f16", "w8bf16", "w4bf16", "w8f16", "w4f16")


@dataclass
class Source:
    """The float Top IR program of a recipe or bundle, its float weights and (pre-quantized route) topq's codes."""

    module: Module
    weight: WeightGetter
    recipe: dict[str, Any]
    quantized: QuantizedGetter | None = None


def load_source(source: Path, prequantized: bool | None) -> Source:
    """Load a recipe or a bundle. A bundle holds its target's packed weights; both routes need the checkpoint's
    (float weights, or the scheme's values computed again, deterministically), so a bundle is re-read from the
    checkpoint its recipe names. `prequantized` None: the route the scheme suggests (see `use_prequantized`)."""
    from topq.core.pipeline import linear_weight_names, load_model, make_quantizer
    from topq.core.plugins import get_plugins

    recipe = source_recipe(source)
    plugins = get_plugins()
    scheme = plugins.schemes.get(recipe.quant.scheme)
    options = recipe.to_dict()["quant"]
    refuse_activation_quantization(scheme, options)
    model = load_model(recipe, plugins)
    quantized: QuantizedGetter | None = None
    if use_prequantized(scheme, options, prequantized):
        # Calibrated schemes (AWQ) may rewrite float tensors too; make_quantizer puts them in model.weight.
        quantizer = make_quantizer(model, recipe, plugins, linear_weight_names(model.module))
        quantized = quantizer.values
    return Source(model.module, lambda name: np.asarray(model.weight(name), dtype=np.float32), recipe.to_dict(),
                  quantized)


def refuse_activation_quantization(scheme: QuantScheme, options: Mapping[str, Any]) -> None:
    """TPU-MLIR has no activation-INT8 LLM mode, so W8A8 cannot be handed over (known from what the scheme
    produces, before any calibration)."""
    if scheme.produces(options).int8_activations:
        raise TopqError(f"quant scheme {scheme.name} (W8A8) has no TPU-MLIR route; export a weight-only or float "
                        "recipe")


def use_prequantized(scheme: QuantScheme, options: Mapping[str, Any], wanted: bool | None) -> bool:
    """The pre-quantized route by default for schemes whose values TPU-MLIR cannot compute itself (calibrated
    algorithms, a checkpoint's own codes); the float route (TPU-MLIR's RTN) for float and RTN schemes."""
    if not scheme.produces(options).weight_bits:
        if wanted:
            raise TopqError(f"--option route=prequantized: scheme {scheme.name} quantizes no weights")
        return False
    if wanted is not None:
        return wanted
    return bool(scheme.needs_calibration or scheme.stored is not None)


def default_quantize(quant: dict[str, Any]) -> str:
    """TPU-MLIR's `--quantize` for a recipe's quant section (the float route quantizes with RTN)."""
    from topq.core.plugins import get_plugins

    scheme = get_plugins().schemes.get(str(quant["scheme"]))
    refuse_activation_quantization(scheme, quant)
    act = scheme.produces(quant).compute_dtype
    bits = quant.get("bits") or scheme.weight_bits
    if bits is None:
        return "bf16" if act == "f32" else str(act)
    return f"w{bits}{act if act != 'f32' else 'bf16'}"


def net_names(module: Module) -> dict[str, str]:
    """topq function name → LLM-TPU net name (decode variants `block_cache_i_S` become `block_cache_i_k`,
    k = 1, 2, ... over the shorter KV lengths, as TPU-MLIR's converter numbers its decode chunks)."""
    variants = module.attrs.get("topq.decode_variants")
    shorter = sorted(int(v) for v in variants)[:-1] if isinstance(variants, list) and variants else []
    names: dict[str, str] = {}
    for function in module:
        name = function.name
        head, _, tail = name.rpartition("_")
        if name.startswith("block_cache_") and head.count("_") == 2 and tail.isdigit() and int(tail) in shorter:
            name = f"{head}_{shorter.index(int(tail)) + 1}"
        names[function.name] = name
    return names


def chunk_of(net: str) -> str | None:
    """`block_cache_i` for a decode-chunk net `block_cache_i_k`, else None."""
    parts = net.split("_")
    return "_".join(parts[:3]) if net.startswith("block_cache_") and len(parts) == 4 else None


def deploy_args(net: Net, quantize: str, group_size: int, symmetric: bool, chip: str,
                has_chunks: bool = False) -> list[str]:
    """model_deploy.py's arguments for one net, as TPU-MLIR's own LLM converter passes them."""
    args = ["--mlir", f"{net.name}.mlir", "--chip", chip, "--model", f"{net.name}.bmodel"]
    half = "bf16" if "bf16" in quantize or quantize == "f32" else "f16"
    if net.stage is not None:  # transformer blocks: the weight quantization, kv outputs in the compute dtype
        args += ["--quantize", quantize.upper(), "--quant_input", "--quant_output"]
        if quantize.startswith("w"):
            args += ["--q_group_size", str(group_size)] + (["--q_symmetric"] if symmetric else [])
        args += ["--addr_mode", "io_alone" if net.stage == "decode" else "basic"]
        base = chunk_of(net.name)
        if base is not None:  # a decode chunk reuses its block_cache's io layout (one net, several stages)
            args += ["--use_io_alone_config", f"../{base}/io_alone_config.json"]
        elif net.stage == "decode" and has_chunks:
            args += ["--save_io_alone_config", "io_alone_config.json"]
    elif net.name == "greedy_head":
        args += ["--addr_mode", "io_alone"]
    elif net.name == "lm_head":
        args += ["--quantize", half.upper(), "--quant_input", "--addr_mode", "basic"]
    else:
        args += ["--quantize", half.upper(), "--quant_input", "--quant_output", "--addr_mode", "basic"]
    return args + ["--high_precision", "--disable_gdma_check"]


def write_net(net: Net, out_dir: Path) -> Path:
    directory = out_dir / net.name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{net.name}.mlir").write_text(net.mlir, encoding="utf-8")
    np.savez(directory / net.weight_file, **net.weights)  # type: ignore[arg-type]  # numpy's stub types **kwds badly
    return directory


def export_nets(module: Module, get_weight: WeightGetter, vocab_size: int | None,
                quantized: QuantizedGetter | None = None) -> list[Net]:
    """Every function of `module` as a TPU-MLIR net (refusing unmapped ops by name), plus greedy_head."""
    names = net_names(module)
    functions: list[Function] = list(module)
    nets = [translate_function(f, get_weight, names[f.name], quantized, chunk_of(names[f.name])) for f in functions]
    if vocab_size is not None:
        nets.append(greedy_head(vocab_size))
    return nets


def _bool_option(value: str, key: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise TopqError(f"--option {key}: expected true or false, got {value!r}")


KNOWN_OPTIONS = ("quantize", "group_size", "chip", "combine", "nets", "route")
ROUTES = ("float", "prequantized")


def export(request: ExportRequest) -> dict[str, Any]:
    unknown = sorted(set(request.options) - set(KNOWN_OPTIONS))
    if unknown:
        raise TopqError(f"exporter tpu-mlir: unknown option {unknown[0]!r} (known options: {', '.join(KNOWN_OPTIONS)})")
    do_combine = _bool_option(request.options.get("combine", "true"), "combine")  # options fail before the load
    tpu = find_tpu_mlir(request.tool)
    route = request.options.get("route")
    if route is not None and route not in ROUTES:
        raise TopqError(f"--option route: {route!r} is not one of {', '.join(ROUTES)}")
    loaded = load_source(request.source, None if route is None else route == "prequantized")
    module, recipe = loaded.module, loaded.recipe
    quant = recipe["quant"]
    quantize = request.options.get("quantize", "").lower() or default_quantize(quant)
    if quantize not in QUANTIZE_MODES:
        raise TopqError(f"--option quantize: {quantize!r} is not one of {', '.join(QUANTIZE_MODES)}")
    try:
        group_size = int(request.options.get("group_size", quant.get("group_size") or 64))
    except ValueError:
        raise TopqError(f"--option group_size must be an integer, got {request.options['group_size']!r}") from None
    chip = request.options.get("chip", "bm1684x")
    vocab = next((f.results[0].shape[-1] for f in module if f.name == "lm_head"), None)
    nets = export_nets(module, loaded.weight, vocab, loaded.quantized)

    out_dir = request.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    route_used = "prequantized" if loaded.quantized is not None else "float"
    manifest: dict[str, Any] = {"format": "topq-tpu-mlir-export", "version": 1, "chip": chip, "quantize": quantize,
                                "group_size": group_size, "route": route_used, "nets": []}
    jobs: list[tuple[Path, list[str]]] = []
    has_chunks = any(chunk_of(net.name) for net in nets)
    for net in nets:
        directory = write_net(net, out_dir)
        args = deploy_args(net, quantize, group_size, bool(quant.get("symmetric")), chip, has_chunks)
        jobs.append((directory, args))
        manifest["nets"].append({
            "name": net.name, "stage": net.stage, "mlir": f"{net.name}/{net.name}.mlir",
            "weights": f"{net.name}/{net.weight_file}",
            "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in net.inputs],
            "outputs": net.outputs, "model_deploy": args,
        })
    summary: dict[str, Any] = {"output": str(out_dir), "nets": [n.name for n in nets], "quantize": quantize,
                               "route": route_used}
    wanted = [n for n in request.options.get("nets", "").split(",") if n]
    if wanted:
        known = {net.name for net in nets}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise TopqError(f"--option nets: no net {missing[0]!r} (nets: {', '.join(sorted(known))})")
        jobs = [job for job in jobs if job[0].name in wanted]
    if tpu is not None:
        summary.update(_compile(tpu, jobs, out_dir, request, manifest, do_combine))
    (out_dir / "export.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return summary


def _compile(tpu: TpuMlir, jobs: list[tuple[Path, list[str]]], out_dir: Path, request: ExportRequest,
             manifest: dict[str, Any], do_combine: bool) -> dict[str, Any]:
    # Decode chunks need their block_cache's io_alone_config.json: a second round.
    first = [job for job in jobs if chunk_of(job[0].name) is None]
    deploy_all(tpu, first, request.jobs, request.progress)
    deploy_all(tpu, [job for job in jobs if chunk_of(job[0].name) is not None], request.jobs, request.progress)
    bmodels = [directory / f"{directory.name}.bmodel" for directory, _ in jobs]
    compiled = {b.parent.name: b for b in bmodels}
    for entry in manifest["nets"]:
        if entry["name"] in compiled:
            entry["bmodel"] = str(compiled[entry["name"]].relative_to(out_dir))
    result: dict[str, Any] = {"bmodels": [str(b) for b in bmodels]}
    if do_combine:
        combined = out_dir / "model.bmodel"
        combine(tpu, bmodels, combined)
        manifest["combined"] = combined.name
        result["combined"] = str(combined)
    return result


@topq.hookimpl
def register_exporters(register: Register[Exporter]) -> None:
    register(Exporter("tpu-mlir", "Top MLIR + weight npz per net for TPU-MLIR (and bmodels when it is installed)",
                      export=export))


