"""Exporters `gptq`, `awq`, `compressed-tensors`: a quantized model as a standard Hugging Face checkpoint.

`topq export gptq|awq|compressed-tensors RECIPE_OR_BUNDLE DIR` writes `DIR/config.json` (the source's config
with the format's `quantization_config`), `DIR/model.safetensors` (every decoder linear packed as the format
stores it, every other tensor as the checkpoint stores it) and the tokenizer files, so transformers, vLLM,
TPU-MLIR's `llm_convert.py` and topq's own `quant.scheme: auto` load it. The integers are the recipe's
scheme's (GPTQ / AWQ / AutoRound / RTN / a checkpoint's own), computed again from the checkpoint the recipe
names (a bundle holds only its target's packing); AWQ's rewritten norms and biases are written too.

Options (`--option KEY=VALUE`): `scale_dtype` (float16, bfloat16, float32; default float16, what the GPTQ and
AWQ kernels read); gptq only: `checkpoint_format` (gptq = v1, zeros stored minus one, the default; gptq_v2).
DIR must be new or empty; it is written in a sibling temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import topq
from topq.core.errors import TopqError
from topq.core.export_source import source_recipe
from topq.core.exporter import Exporter, ExportRequest
from topq.core.hookspecs import Register
from topq.core.quant import QuantizedWeight
from topq.io.safetensors import write_safetensors
from topq.plugins.exporters.hf_quantized.packing import (
    gptq_v1_zeros,
    groups_of,
    is_offset_symmetric,
    pack_awq,
    pack_compressed,
    pack_gptq,
    to_unsigned,
)

SCALE_DTYPES: dict[str, np.dtype] = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                                     "float32": np.dtype(np.float32)}
FLOAT_STORED = ("float32", "float16", "bfloat16")
WEIGHT_SUFFIX = ".weight"


@dataclass(frozen=True)
class Layout:
    """(bits, group size or -1 for per channel, symmetric, act-order) of one packed linear."""

    bits: int
    group_size: int
    symmetric: bool
    act_order: bool


@dataclass(frozen=True)
class Format:
    """One exported format: its allowed bit widths, the packer of one linear and its quantization_config."""

    name: str
    bits: tuple[int, ...]
    options: tuple[str, ...]
    pack: Callable[[QuantizedWeight, Layout, dict[str, str], str], tuple[dict[str, np.ndarray], int]]
    config: Callable[[dict[str, Layout], dict[str, str]], dict[str, Any]]
    act_order: bool = True
    per_channel: bool = True
    mixed: bool = True  # linears may differ in bits / group size
    whole_words: bool = True  # K and N fill whole packed words (compressed-tensors pads instead)


# ------------------------------------------------------------------------------------------------ the formats
def _scale_dtype(options: dict[str, str]) -> np.dtype:
    return SCALE_DTYPES[options.get("scale_dtype", "float16")]


def _pack_gptq(weight: QuantizedWeight, layout: Layout, options: dict[str, str],
               what: str) -> tuple[dict[str, np.ndarray], int]:
    v1 = options.get("checkpoint_format", "gptq") == "gptq"
    shifted = 0
    if v1:
        weight, shifted = gptq_v1_zeros(weight, what)
    return pack_gptq(weight, _scale_dtype(options), v1), shifted


def _pack_awq(weight: QuantizedWeight, layout: Layout, options: dict[str, str],
              what: str) -> tuple[dict[str, np.ndarray], int]:
    return pack_awq(weight, _scale_dtype(options)), 0


def _pack_ct(weight: QuantizedWeight, layout: Layout, options: dict[str, str],
             what: str) -> tuple[dict[str, np.ndarray], int]:
    return pack_compressed(weight, _scale_dtype(options), layout.symmetric), 0


def _meta() -> dict[str, Any]:
    return {"quantizer": [f"topq:{topq.__version__}"]}


def _gptq_config(layouts: dict[str, Layout], options: dict[str, str]) -> dict[str, Any]:
    default, overrides = _split_layouts(layouts)
    config: dict[str, Any] = {
        "quant_method": "gptq", "bits": default.bits, "group_size": default.group_size,
        "desc_act": any(lay.act_order for lay in layouts.values()), "sym": default.symmetric, "lm_head": False,
        "checkpoint_format": options.get("checkpoint_format", "gptq"), "pack_dtype": "int32", "meta": _meta()}
    if overrides:  # GPTQModel's per-module overrides: "+:" + a regex re.match'es the module name
        config["dynamic"] = {f"+:^{re.escape(name)}$": {"bits": lay.bits, "group_size": lay.group_size,
                                                         "sym": lay.symmetric, "desc_act": lay.act_order}
                             for name, lay in overrides.items()}
    return config


def _awq_config(layouts: dict[str, Layout], options: dict[str, str]) -> dict[str, Any]:
    default = next(iter(layouts.values()))
    # zero_point: the zeros are stored as they are, so symmetric weights (zeros 8) read the same.
    return {"quant_method": "awq", "bits": 4, "group_size": default.group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def _ct_weights(layout: Layout) -> dict[str, Any]:
    per_channel = layout.group_size == -1
    return {"num_bits": layout.bits, "type": "int", "symmetric": layout.symmetric,
            "strategy": "channel" if per_channel else "group", "group_size": None if per_channel else layout.group_size,
            "actorder": "group" if layout.act_order else None, "dynamic": False, "block_structure": None,
            "observer": "minmax", "observer_kwargs": {}}


def _ct_config(layouts: dict[str, Layout], options: dict[str, str]) -> dict[str, Any]:
    by_layout: dict[Layout, list[str]] = {}
    for name, layout in layouts.items():
        by_layout.setdefault(layout, []).append(name)
    if len(by_layout) == 1:
        targets_of = {next(iter(by_layout)): ["Linear"]}
    else:  # several schemes: each group names its modules (no class target that would match them all)
        targets_of = by_layout
    groups = {f"group_{i}": {"targets": list(targets), "weights": _ct_weights(layout), "input_activations": None,
                             "output_activations": None, "format": "pack-quantized"}
              for i, (layout, targets) in enumerate(targets_of.items())}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "global_compression_ratio": None}


def _split_layouts(layouts: dict[str, Layout]) -> tuple[Layout, dict[str, Layout]]:
    """The most common layout (the config's top-level values) and the modules that differ from it."""
    default = Counter(layouts.values()).most_common(1)[0][0]
    return default, {name: lay for name, lay in layouts.items() if lay != default}


FORMATS = {
    "gptq": Format("gptq", (2, 3, 4, 8), ("scale_dtype", "checkpoint_format"), _pack_gptq, _gptq_config),
    "awq": Format("awq", (4,), ("scale_dtype",), _pack_awq, _awq_config, act_order=False, per_channel=False,
                  mixed=False),
    "compressed-tensors": Format("compressed-tensors", (4, 8), ("scale_dtype",), _pack_ct, _ct_config,
                                 whole_words=False),
}


# ------------------------------------------------------------------------------------------------ the export
def check_options(fmt: Format, options: dict[str, str]) -> None:
    unknown = sorted(set(options) - set(fmt.options))
    if unknown:
        raise TopqError(f"exporter {fmt.name}: unknown option {unknown[0]!r} (known options: {', '.join(fmt.options)})")
    if options.get("scale_dtype", "float16") not in SCALE_DTYPES:
        raise TopqError(f"--option scale_dtype: {options['scale_dtype']!r} is not one of {', '.join(SCALE_DTYPES)}")
    if options.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise TopqError(f"--option checkpoint_format: {options['checkpoint_format']!r} is not one of gptq, gptq_v2")


def layout_of(weight: QuantizedWeight, fmt: Format, what: str) -> Layout:
    """The weight's layout, refused in one line when the format cannot store it."""
    n, k = weight.codes.shape
    if weight.bits not in fmt.bits:
        raise TopqError(f"{what}: {weight.bits}-bit weights cannot be exported as {fmt.name} "
                        f"(supported: {', '.join(map(str, fmt.bits))} bits)")
    per_channel = weight.group_size >= k
    act_order = weight.g_idx is not None
    if act_order and not fmt.act_order:
        raise TopqError(f"{what}: act-order groups (g_idx) cannot be exported as {fmt.name}")
    if per_channel and not fmt.per_channel:
        raise TopqError(f"{what}: per-channel scales cannot be exported as {fmt.name}; use a group size")
    if fmt.whole_words and (k * weight.bits % 32 or n * weight.bits % 32):
        raise TopqError(f"{what}: shape [{n}, {k}] does not pack into whole 32-bit words at {weight.bits} bits")
    return Layout(weight.bits, -1 if per_channel else weight.group_size, is_offset_symmetric(weight), act_order)


def normalized(weight: QuantizedWeight) -> QuantizedWeight:
    """Unsigned form, and no g_idx when it is the trivial arange(K) // group_size."""
    weight = to_unsigned(weight)
    k = weight.codes.shape[1]
    if weight.g_idx is not None and np.array_equal(groups_of(weight), np.arange(k) // weight.group_size):
        weight = QuantizedWeight(codes=weight.codes, scales=weight.scales, zeros=weight.zeros, bits=weight.bits,
                                 group_size=weight.group_size, symmetric=weight.symmetric, g_idx=None)
    return weight


def export_as(fmt: Format, request: ExportRequest) -> dict[str, Any]:
    from topq.core.pipeline import linear_weight_names, load_model, make_quantizer
    from topq.core.plugins import get_plugins

    options = dict(request.options)
    check_options(fmt, options)
    if request.tool is not None:
        raise TopqError(f"exporter {fmt.name} drives no tool; drop --tool")
    out_dir = request.out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise TopqError(f"output {out_dir} exists and is not an empty directory")
    recipe = source_recipe(request.source)
    plugins = get_plugins()
    scheme = plugins.schemes.get(recipe.quant.scheme)
    quant = recipe.to_dict()["quant"]
    product = scheme.produces(quant)
    if product.int8_activations:
        raise TopqError(f"quant scheme {scheme.name} quantizes activations (W8A8); {fmt.name} stores weight-only "
                        "quantization")
    if not product.weight_bits:
        raise TopqError(f"quant scheme {scheme.name} quantizes no weights; nothing to export as {fmt.name}")
    if product.act_order and not fmt.act_order:  # known from the options: refuse before calibrating
        raise TopqError(f"quant scheme {scheme.name} with act_order makes act-order groups (g_idx), which cannot "
                        f"be exported as {fmt.name}")
    model = load_model(recipe, plugins)
    if model.family.map_weights is not None:
        raise TopqError(f"model family {model.family.name} maps the checkpoint's tensors (fused or renamed); "
                        f"{fmt.name} export writes Hugging Face names only for families that read them as stored")
    quantizer = make_quantizer(model, recipe, plugins, linear_weight_names(model.module))
    lm_head = quantizer.lm_head_name
    if lm_head in quantizer.linear_names and quantizer.values(lm_head) is not None:
        raise TopqError(f"quant.lm_head {recipe.quant.lm_head!r} quantizes {lm_head}; {fmt.name} export keeps it "
                        "float (set quant.lm_head to a float mode such as bf16)")

    store = model.checkpoint.weights
    tensors: dict[str, np.ndarray] = {}
    layouts: dict[str, Layout] = {}
    shifted = 0
    float_dtype = _float_dtype(model.checkpoint.config)
    for name in store.names():
        weight = quantizer.values(name) if name in quantizer.linear_names else None
        if weight is None:
            tensors[name] = _float_tensor(model, name, float_dtype)
            continue
        if not name.endswith(WEIGHT_SUFFIX):
            raise TopqError(f"{name}: a quantized linear's tensor must be named <module>.weight")
        module = name[: -len(WEIGHT_SUFFIX)]
        weight = normalized(weight)
        layouts[module] = layout_of(weight, fmt, module)
        packed, count = fmt.pack(weight, layouts[module], options, module)
        shifted += count
        tensors.update({f"{module}.{part}": array for part, array in packed.items()})
    if not layouts:
        raise TopqError(f"{request.source}: no quantized linear to export")
    kinds = sorted({f"{lay.bits}-bit group {lay.group_size}" for lay in layouts.values()})
    if not fmt.mixed and len(kinds) > 1:
        raise TopqError(f"{fmt.name} stores one layout for all linears; this model mixes {', '.join(kinds)}")

    config = _hf_config(model.checkpoint.path, model.checkpoint.config)
    _set_compute_dtype(config, product.compute_dtype)
    config["quantization_config"] = fmt.config(layouts, options)
    files = {"config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}
    files.update(model.checkpoint.tokenizer_files)
    generation = model.checkpoint.path / "generation_config.json"
    if model.checkpoint.path.is_dir() and generation.is_file():
        files["generation_config.json"] = generation.read_text(encoding="utf-8")
    _write_directory(out_dir, tensors, files)
    return {"output": str(out_dir), "format": fmt.name, "quantized": len(layouts), "tensors": len(tensors),
            "zero_points_shifted": shifted, "quantization_config": config["quantization_config"]}


def _float_dtype(config: dict[str, Any]) -> np.dtype:
    """The config's float dtype (for tensors a checkpoint does not store as a float array, e.g. GGUF blocks)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").replace("torch.", "")
    return SCALE_DTYPES.get(name, np.dtype(np.float32))


def _float_tensor(model: Any, name: str, dtype: np.dtype) -> np.ndarray:
    """A tensor that stays float: as stored, unless the scheme rewrote it (AWQ's folded norms), then in the
    stored dtype."""
    store = model.checkpoint.weights
    stored = store.dtype(name)
    target = SCALE_DTYPES[stored] if stored in FLOAT_STORED else dtype
    if name in model.extra_weights:
        return np.asarray(model.extra_weights[name], dtype=np.float32).astype(target)
    if stored in FLOAT_STORED:
        return np.asarray(store.get_raw(name))
    return store.get(name).astype(target)


COMPUTE_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16"}


def _set_compute_dtype(config: dict[str, Any], compute_dtype: str) -> None:
    """The config's dtype becomes the scheme's compute dtype (bf16 / f16): a quantized checkpoint's dtype is what
    its kernels compute in, and loaders refuse a float32 one (TPU-MLIR's llm_convert: "Not support quantize type:
    torch.float32 with bits: 4"). Float tensors keep their stored dtype; loaders cast them."""
    name = COMPUTE_DTYPE_NAMES.get(compute_dtype)
    if name is None:
        return
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    for key in keys:
        config[key] = name


def _hf_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's config.json as written (not topq's normalised copy), else the config the reader built."""
    raw = path / "config.json" if path.is_dir() else None
    if raw is not None and raw.is_file():
        try:
            loaded = json.loads(raw.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise TopqError(f"{raw}: cannot read ({exc})") from None
        if isinstance(loaded, dict):
            config = loaded
    config = dict(config)
    config.pop("quantization_config", None)
    return config


def _write_directory(out_dir: Path, tensors: dict[str, np.ndarray], files: dict[str, str]) -> None:
    """Write everything into a sibling temporary directory, then rename it onto DIR (new or empty)."""
    parent = out_dir.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=parent))
    except OSError as exc:
        raise TopqError(f"output {out_dir}: cannot write ({exc.strerror or exc})") from None
    try:
        write_safetensors(staging / "model.safetensors", tensors, {"format": "pt"})
        for filename, text in files.items():
            (staging / filename).write_text(text, encoding="utf-8")
        os.replace(staging, out_dir)  # replaces an empty directory, never a non-empty one
    except OSError as exc:
        raise TopqError(f"output {out_dir}: cannot write ({exc.strerror or exc})") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _exporter(fmt: Format, description: str) -> Exporter:
    return Exporter(fmt.name, description, export=lambda request: export_as(fmt, request))


@topq.hookimpl
def register_exporters(register: Register[Exporter]) -> None:
    register(_exporter(FORMATS["gptq"], "Hugging Face GPTQ checkpoint (qweight / qzeros / scales / g_idx, v1 zeros)"))
    register(_exporter(FORMATS["awq"], "Hugging Face AWQ checkpoint (AutoAWQ GEMM packing, 4-bit)"))
    register(_exporter(FORMATS["compressed-tensors"],
                       "Hugging Face compressed-tensors checkpoint (pack-quantized, weight-only)"))
