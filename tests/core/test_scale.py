"""Conversion at scale: units compiled in parallel and cached, byte-identical bundles, interrupted conversions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from data_paths import REPO
from host_bundles import TinyCheckpoint

from topq.core.build import split_units
from topq.core.pipeline import convert
from topq.core.recipe import recipe_from_defaults

STAGES = {"seq_length": 64, "max_input_length": 16, "decode_chunks": [32]}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: TinyCheckpoint) -> Path:
    directory = tmp_path_factory.mktemp("scale_tiny")
    tiny_checkpoint("qwen2", directory)
    return directory


def _convert(checkpoint: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    recipe = recipe_from_defaults(model={"path": str(checkpoint)}, quant={"scheme": "w4bf16", "group_size": 32},
                                  target={"chip": "bm1684x"}, stages=STAGES, output={"path": str(out)})
    return convert(recipe, progress=False, **kwargs)


def test_units_split_by_layer() -> None:
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight.packed", "rope.cos",
             "model.layers.0.self_attn.q_proj.weight.scale", "model.layers.10.input_layernorm.weight"]
    assert split_units(names) == {
        "globals": ["model.embed_tokens.weight", "rope.cos"],
        "layer_0": ["model.layers.0.self_attn.q_proj.weight.scale"],
        "layer_1": ["model.layers.1.mlp.up_proj.weight.packed"],
        "layer_10": ["model.layers.10.input_layernorm.weight"],
    }


def _bytes_of(checkpoint: Path, out: Path, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
    """Convert to `out` (the recipe, output path included, is part of the bundle) and return its bytes."""
    summary = _convert(checkpoint, out, **kwargs)
    return out.read_bytes(), summary


def test_jobs_and_cache_give_identical_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.topq"
    inline, s_inline = _bytes_of(tiny_dir, out, jobs=1)
    cold, s_cold = _bytes_of(tiny_dir, out, jobs=2, use_cache=True, cache_dir=tmp_path / "cache")
    warm, s_warm = _bytes_of(tiny_dir, out, jobs=2, use_cache=True, cache_dir=tmp_path / "cache")
    one, s_one = _bytes_of(tiny_dir, out, jobs=1, use_cache=True, cache_dir=tmp_path / "cache1")
    assert inline == cold == warm == one
    assert s_inline["units"] == 3 and s_inline["executor"] == "inline"
    assert s_cold["executor"] == "local" and s_cold["units_built"] == 3 and s_cold["units_reused"] == 0
    assert s_warm["units_built"] == 0 and s_warm["units_reused"] == 3
    assert s_one["units_built"] == 3
    # A new output path changes nothing the units depend on: all of them come from the cache.
    moved = _convert(tiny_dir, tmp_path / "elsewhere" / "m.topq", jobs=2, use_cache=True, cache_dir=tmp_path / "cache")
    assert moved["units_built"] == 0 and moved["units_reused"] == 3


def test_a_recipe_change_rebuilds_only_what_it_touches(tiny_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _convert(tiny_dir, tmp_path / "a.topq", jobs=1, use_cache=True, cache_dir=cache)
    recipe = recipe_from_defaults(model={"path": str(tiny_dir)}, quant={"scheme": "w4bf16", "group_size": 64},
                                  target={"chip": "bm1684x"}, stages=STAGES, output={"path": str(tmp_path / "b")})
    changed = convert(recipe, progress=False, jobs=1, use_cache=True, cache_dir=cache)
    assert changed["units_built"] == 3 and changed["units_reused"] == 0  # every layer's packing changed


def test_ray_executor_matches_local(tiny_dir: Path, tmp_path: Path) -> None:
    import ray  # a test dependency: scripts/setup.sh installs topq[ray]

    out = tmp_path / "model.topq"
    local_bytes, local = _bytes_of(tiny_dir, out, jobs=2, use_cache=True, cache_dir=tmp_path / "c_local")
    try:
        ray_bytes, distributed = _bytes_of(tiny_dir, out, jobs=2, executor="ray", use_cache=True,
                                           cache_dir=tmp_path / "c_ray")
    finally:
        ray.shutdown()
    assert distributed["executor"] == "ray" and distributed["units_built"] == local["units_built"] == 3
    assert ray_bytes == local_bytes


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_killed_conversion_leaves_no_output_and_resumes(tmp_path: Path, sig: int) -> None:
    """A conversion big enough to be interrupted mid-way: no bundle, no temp file; the next run completes and
    reuses the units built before the signal."""
    from tiny_models import build_tiny

    checkpoint = tmp_path / "ckpt"
    build_tiny("llama", checkpoint, overrides={"num_hidden_layers": 24, "hidden_size": 256, "intermediate_size": 1024,
                                               "num_attention_heads": 8, "num_key_value_heads": 4})
    out = tmp_path / "out" / "model.topq"
    cache = tmp_path / "cache"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {checkpoint}}}\nquant: {{scheme: w4bf16, group_size: 64}}\n"
                      f"target: {{chip: bm1684x}}\nstages: {{seq_length: 64, max_input_length: 16}}\n"
                      f"output: {{path: {out}}}\n")
    cmd = [sys.executable, "-m", "topq.core.cli", "convert", str(recipe), "--jobs", "1", "--cache-dir", str(cache),
           "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    units = cache / "units"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if units.exists() and len(list(units.glob("*.safetensors"))) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"conversion finished before it could be interrupted: {proc.communicate()}"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith("error:"), err
    assert "Traceback" not in err
    assert not out.exists()
    assert not [p for p in out.parent.glob("*") if p.name.startswith(".")], "a temp file was left behind"
    built_before = len(list(units.glob("*.safetensors")))
    assert 0 < built_before < 25

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import json

    summary = json.loads(done.stdout)
    assert out.exists() and summary["units_reused"] >= built_before and summary["units"] == 25
