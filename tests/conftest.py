"""Shared, session-scoped fixtures: tiny transformers models with their host bundles, and SmolLM2.

Building, converting and opening models is the expensive part of the host-runtime tests, so each model is
built and converted at most once per test session and shared read-only. A test that mutates a Session
makes its own (sessions are cheap; bundles are not). A fixture that needs a tiny checkpoint of its own (its
bundles' recipes name that directory) writes it with `tiny_checkpoint`, which builds each kind once.

Helpers shared by test files are plain modules in tests/helpers (data_paths, host_bundles, smol_model,
tiny_models, ir_gen, quantized_writers); test files import those, never each other.
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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Shared helpers live in tests/helpers (on sys.path through pyproject's pytest `pythonpath`); their names are
# re-exported here for tests that import them from conftest.
from data_paths import AUSTEN, TESTS
from host_bundles import SMOL_STAGES, TINY_STAGES, TinyCheckpoint, TinyHost, convert_host
from smol_model import SMOL_NAME, SMOL_RECIPE_PATH, load_smol_reference, smol_path

__all__ = ["AUSTEN", "SMOL_NAME", "SMOL_RECIPE_PATH", "SMOL_STAGES", "TESTS", "TINY_STAGES", "TinyCheckpoint",
           "TinyHost", "convert_host", "load_smol_reference", "smol_path"]

@pytest.fixture(scope="module")
def loaded_tiny(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Any:
    """`loaded_tiny(kind, seq_len)`: a tiny model loaded as topq sees it (`load_model`), Top IR built at
    max_input_length = seq_length = seq_len without prefill_kv, as the calibration layer loop runs it. One per
    module: calibration tests may change a model's extra weights."""
    from topq.core.pipeline import load_model
    from topq.core.recipe import recipe_from_defaults

    cache: dict[tuple[str, int], Any] = {}

    def get(kind: str, seq_len: int) -> Any:
        if (kind, seq_len) not in cache:
            directory = tmp_path_factory.mktemp(f"loaded_{kind}")
            tiny_checkpoint(kind, directory)
            cache[kind, seq_len] = load_model(recipe_from_defaults(
                model={"path": str(directory)},
                stages={"seq_length": seq_len, "max_input_length": seq_len, "prefill_kv": False}))
        return cache[kind, seq_len]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint() -> TinyCheckpoint:
    """`tiny_checkpoint(kind, directory)`: write the tiny model of `kind` (tests/helpers/tiny_models.py, seed 0,
    float32) as a safetensors checkpoint into `directory` and return the model in eval mode.

    Each kind is built once per session. Later calls write the first build's files again, byte for byte (a
    bundle's recipe names its checkpoint directory, so every fixture keeps a directory of its own), hand out a
    private copy of the model, and leave torch's global generator where a fresh build leaves it."""
    import copy

    import torch
    from tiny_models import build_tiny

    built: dict[str, tuple[Any, dict[str, bytes], torch.Tensor]] = {}

    def write(kind: str, directory: Path) -> Any:
        if kind not in built:
            before = set(directory.rglob("*")) if directory.exists() else set()
            model = build_tiny(kind, directory)
            files = {str(path.relative_to(directory)): path.read_bytes()
                     for path in sorted(set(directory.rglob("*")) - before) if path.is_file()}
            built[kind] = (copy.deepcopy(model), files, torch.random.get_rng_state())  # kept pristine
            return model
        model, files, generator_after_build = built[kind]
        for name, data in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)
        torch.random.set_rng_state(generator_after_build)
        return copy.deepcopy(model)

    return write


@pytest.fixture(scope="session")
def tiny_host(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Callable[..., TinyHost]:
    """`tiny_host(kind, prefill_kv=True)`: the tiny model of `kind` (tests/helpers/tiny_models.py) and its host
    bundle (seq_length 64, max_input_length 16, decode_chunks [16, 32]). Each model is built once, each bundle
    converted once per session."""
    models: dict[str, tuple[Any, Path]] = {}
    bundles: dict[tuple[str, bool], TinyHost] = {}

    def get(kind: str, prefill_kv: bool = True) -> TinyHost:
        if kind not in models:
            directory = tmp_path_factory.mktemp(f"tiny_{kind}")
            models[kind] = (tiny_checkpoint(kind, directory), directory)
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
