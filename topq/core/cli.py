"""The `topq` command line. Bad input ends with one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from topq.core.errors import TopqError
from topq.io.files import atomic_file


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj))


@click.group()
@click.version_option(package_name="topq")
def cli() -> None:
    """topq: quantize and compile LLM checkpoints into deployable bundles, and run them."""


# ------------------------------------------------------------------------------------------ convert
@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key (repeatable).")
@click.option("--dump-ir", type=click.Path(file_okay=False), help="Write one .mlir per function and dialect here.")
@click.option("--jobs", type=click.IntRange(min=1),
              help="Parallel workers for calibration and unit compilation (default: the core count).")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where calibration tasks run and units compile: local processes or a Ray cluster.")
@click.option("--ray-address", help="Ray cluster address (default: start a local Ray instance).")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Build cache (default: $TOPQ_CACHE_DIR or "
              "~/.cache/topq).")
@click.option("--no-cache", is_flag=True, help="Do not reuse or keep built units.")
@click.option("--kernel-module", "kernel_modules", multiple=True, metavar="MODULE",
              help="Allow the recipe's kernels: entries to import MODULE (repeatable; topq's and installed plugins' "
                   "modules are always allowed).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def convert(recipe: str, overrides: tuple[str, ...], dump_ir: str | None, jobs: int | None, executor: str,
            ray_address: str | None, cache_dir: str | None, no_cache: bool, kernel_modules: tuple[str, ...],
            as_json: bool) -> None:
    """Convert a checkpoint into a bundle as RECIPE says."""
    import os

    from topq.core.pipeline import convert as run_convert
    from topq.core.plugins import KERNEL_MODULES_ENV
    from topq.core.recipe import load_recipe

    for name in kernel_modules:  # a typo must not pass unnoticed until a recipe's kernel is looked up
        if _find_module(name) is None:
            raise TopqError(f"--kernel-module {name}: no such module")
    if kernel_modules:  # workers (forked, or Ray's from this environment) see it too
        os.environ[KERNEL_MODULES_ENV] = ",".join(kernel_modules)

    loaded = load_recipe(recipe, list(overrides))
    summary = run_convert(loaded, Path(dump_ir) if dump_ir else None, progress=not as_json,
                          jobs=jobs or os.cpu_count() or 1, executor=executor, ray_address=ray_address,
                          cache_dir=Path(cache_dir) if cache_dir else None, use_cache=not no_cache)
    if as_json:
        _emit_json(summary)
    else:
        click.echo(f"wrote {summary['output']} ({summary['bytes'] / 1e6:.1f} MB, target {summary['target']}, "
                   f"scheme {summary['scheme']}, {summary['functions']} functions, {summary['seconds']} s)")


# ------------------------------------------------------------------------------------------ run
def _find_module(name: str) -> object | None:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that does not exist, or an empty / relative name
        return None


def _sampling(greedy: bool, temperature: float | None, top_k: int, top_p: float, seed: int | None,
              repetition_penalty: float) -> Any:
    from topq.ir.sampling import Sampling

    use_greedy = greedy or temperature is None or temperature == 0
    return Sampling(greedy=use_greedy, temperature=temperature or 1.0, top_k=top_k, top_p=top_p, seed=seed,
                    repetition_penalty=repetition_penalty)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise TopqError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise TopqError("--prompt-ids is empty")
    return ids


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--prompt", help="Prompt text (tokenized with the bundle's tokenizer).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids.")
@click.option("--chat", "use_chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--greedy", is_flag=True, help="Greedy decoding (the default unless --temperature is given).")
@click.option("--temperature", type=click.FloatRange(min=0.0))
@click.option("--top-k", default=0, type=click.IntRange(min=0))
@click.option("--top-p", default=1.0, type=click.FloatRange(min=0.0, max=1.0, min_open=True))
@click.option("--repetition-penalty", default=1.0, type=click.FloatRange(min=0.0, min_open=True))
@click.option("--seed", type=click.IntRange(min=0))
@click.option("--logits-out", type=click.Path(dir_okay=False), help="Save float32 logits [steps, vocab] (.npy).")
@click.option("--json", "as_json", is_flag=True)
def run(bundle: str, prompt: str | None, prompt_ids: str | None, use_chat: bool, max_new_tokens: int,
        greedy: bool, temperature: float | None, top_k: int, top_p: float, repetition_penalty: float,
        seed: int | None, logits_out: str | None, as_json: bool) -> None:
    """Generate a continuation of a prompt with BUNDLE."""
    from topq.core.bundle import Bundle
    from topq.core.runtime import Session

    if (prompt is None) == (prompt_ids is None):
        raise TopqError("give exactly one of --prompt and --prompt-ids")
    if temperature is not None and not math.isfinite(temperature):
        raise TopqError(f"--temperature must be a finite number, got {temperature}")
    if logits_out and Path(bundle).exists() and Path(logits_out).resolve() == Path(bundle).resolve():
        raise TopqError(f"--logits-out {logits_out} would overwrite the bundle")
    loaded = Bundle(bundle)
    session = Session(loaded)
    # Text prompts need the tokenizer; --prompt-ids uses it to show text when the bundle has one.
    tokenizer = loaded.tokenizer if prompt is not None or loaded.meta.get("tokenizer") else None
    if prompt is not None:
        assert tokenizer is not None  # chosen just above for a text prompt
        if use_chat:
            ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
        else:
            ids = tokenizer.encode(prompt)
    else:
        ids = _parse_ids(prompt_ids or "")
        if any(not 0 <= t < loaded.spec.vocab_size for t in ids):
            raise TopqError(f"--prompt-ids: every id must be in [0, {loaded.spec.vocab_size})")
    sampling = _sampling(greedy, temperature, top_k, top_p, seed, repetition_penalty)
    tokens: list[int] = []
    all_logits: list[np.ndarray] = []
    printed = ""
    started = time.perf_counter()
    first_token_s = 0.0
    for token, logits in session.generate(ids, max_new_tokens, sampling):
        if not tokens:
            first_token_s = time.perf_counter() - started
        tokens.append(token)
        all_logits.append(np.asarray(logits, dtype=np.float32))
        if not as_json and tokenizer is not None:
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            click.echo(text[len(printed):], nl=False)
            printed = text
    elapsed = time.perf_counter() - started
    if logits_out:
        with atomic_file(Path(logits_out)) as fh:
            np.save(fh, np.stack(all_logits), allow_pickle=False)
    decode_s = elapsed - first_token_s
    result: dict[str, Any] = {
        "tokens": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None,
        "prompt_tokens": len(ids),
        "first_token_s": round(first_token_s, 4),
        "host_tokens_per_s": round((len(tokens) - 1) / decode_s, 3) if len(tokens) > 1 and decode_s > 0 else None,
    }
    predicted = _predicted(loaded, len(ids))
    if predicted is not None:
        result["predicted"] = predicted
    if as_json:
        _emit_json(result)
    else:
        click.echo("")
        if tokenizer is None:
            click.echo(" ".join(map(str, tokens)))


def _predicted(bundle: Any, prompt_len: int) -> dict[str, Any] | None:
    from topq.core.plugins import get_plugins

    target = get_plugins().targets.get(bundle.target)
    if target.perf is None:
        return None
    return target.perf(bundle=bundle, prompt_length=prompt_len)


# ------------------------------------------------------------------------------------------ chat
@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--system", help="A system message.")
def chat(bundle: str, max_new_tokens: int, system: str | None) -> None:
    """Multi-turn chat on stdin/stdout; later turns reuse the KV cache. An empty line or EOF ends it."""
    from topq.core.bundle import Bundle
    from topq.core.runtime import ChatSession

    session = ChatSession(Bundle(bundle), system=system)
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
            line.encode("utf-8")  # undecodable input arrives as lone surrogates (surrogateescape)
        except EOFError:
            break
        except UnicodeError:
            raise TopqError("chat: the input is not UTF-8 text") from None
        if not line.strip():
            break
        for piece in session.reply_stream(line, max_new_tokens):
            click.echo(piece, nl=False)
        click.echo("")


# ------------------------------------------------------------------------------------------ eval
@cli.command(name="eval")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False))
@click.option("--max-tokens", type=click.IntRange(min=2), help="Use only the first N tokens of the text.")
@click.option("--window", type=click.IntRange(min=2), help="Window length (default: seq_length).")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(bundle: str, text_file: str, max_tokens: int | None, window: int | None, as_json: bool) -> None:
    """Perplexity of the compiled model on a text file, over independent windows."""
    from topq.core.bundle import Bundle
    from topq.core.runtime import perplexity

    loaded = Bundle(bundle)
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopqError(f"{text_file}: cannot read text: {exc}") from None
    ids = loaded.tokenizer.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    ppl, count = perplexity(loaded, ids, window)
    if as_json:
        _emit_json({"perplexity": ppl, "tokens": count})
    else:
        click.echo(f"perplexity {ppl:.4f} over {count} predicted tokens")


# ------------------------------------------------------------------------------------------ inspect
@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def inspect(bundle: str, as_json: bool) -> None:
    """Stages, function signatures, sizes (and, for targets that have them, memory map and predicted perf)."""
    from topq.core.bundle import Bundle
    from topq.core.inspect import describe, format_description

    info = describe(Bundle(bundle))
    if as_json:
        _emit_json(info)
    else:
        click.echo(format_description(info))


# ------------------------------------------------------------------------------------------ perf
@cli.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--chip", required=True)
@click.option("--quant", required=True)
@click.option("--seq-length", required=True, type=click.IntRange(min=1))
@click.option("--max-input-length", type=click.IntRange(min=1))
@click.option("--lm-head-quant", default="bf16", show_default=True)
@click.option("--group-size", default=64, show_default=True, type=click.IntRange(min=-1))
@click.option("--json", "as_json", is_flag=True)
def perf(config_path: str, chip: str, quant: str, seq_length: int, max_input_length: int | None,
         lm_head_quant: str, group_size: int, as_json: bool) -> None:
    """Predict first-token latency and decode speed from a config.json alone."""
    from topq.core.plugins import get_plugins

    target = get_plugins().targets.get(chip)
    if target.perf is None:
        raise TopqError(f"target {chip} has no performance model")
    try:
        config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TopqError(f"{config_path}: cannot read config: {exc}") from None
    if not isinstance(config, dict):
        raise TopqError(f"{config_path}: a config is a JSON object, got {type(config).__name__}")
    result = target.perf(config=config, quant=quant, seq_length=seq_length,
                         max_input_length=max_input_length or seq_length, lm_head_quant=lm_head_quant,
                         group_size=group_size)
    if as_json:
        _emit_json(result)
    else:
        for key, value in result.items():
            if not isinstance(value, (dict, list)):
                click.echo(f"{key:>20}: {value}")


# ------------------------------------------------------------------------------------------ ir
@cli.group()
def ir() -> None:
    """Work with IR text files."""


@ir.command(name="check")
@click.argument("file", type=click.Path(dir_okay=False))
def ir_check(file: str) -> None:
    """Parse and verify FILE, then print it in canonical form (like mlir-opt)."""
    from topq.core.plugins import get_plugins
    from topq.ir.parser import parse_module
    from topq.ir.printer import print_module
    from topq.ir.verifier import verify_module

    get_plugins()  # plugins register their ops: target dialects, raw kernels (IR extensions)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopqError(f"{file}: cannot read: {exc}") from None
    module = parse_module(text, source=file)
    verify_module(module)
    click.echo(print_module(module), nl=False)


# ------------------------------------------------------------------------------------------ export
@cli.command()
@click.argument("kind")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--tool", "--tpu-mlir", "tool", metavar="PYTHON",
              help="The other tool's Python (for tpu-mlir: a venv from scripts/setup-tpu-mlir.sh; "
                   "default $TOPQ_TPU_MLIR). Without it only the files are written.")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE", help="An exporter option (repeatable).")
@click.option("--jobs", type=click.IntRange(min=1), help="Parallel tool runs (default: the core count).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def export(kind: str, source: str, directory: str, tool: str | None, options: tuple[str, ...], jobs: int | None,
           as_json: bool) -> None:
    """Export the model of SOURCE (a recipe or a bundle) as KIND (e.g. tpu-mlir) into DIRECTORY."""
    import os

    from topq.core.exporter import ExportRequest
    from topq.core.plugins import get_plugins

    exporter = get_plugins().exporters.get(kind)
    pairs: dict[str, str] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TopqError(f"--option must be KEY=VALUE, got {item!r}")
        pairs[key] = value
    request = ExportRequest(source=Path(source), out_dir=Path(directory), tool=tool, options=pairs,
                            jobs=jobs or os.cpu_count() or 1, progress=not as_json)
    summary = exporter.export(request)
    if as_json:
        _emit_json(summary)
    else:
        click.echo(f"wrote {summary.get('output', directory)}")


# ------------------------------------------------------------------------------------------ plugins
@cli.command()
@click.option("--json", "as_json", is_flag=True)
def plugins(as_json: bool) -> None:
    """List loaded plugins and what each registered."""
    from topq.core.plugins import get_plugins

    loaded = get_plugins()
    rows = [{"name": p.name, "source": p.source, "registered": p.registered} for p in loaded.info]
    schemes = {s.name: [{"name": o.name, "type": o.spec.type, "default": o.spec.default, "doc": o.spec.help,
                         "choices": list(o.spec.choices), "nullable": o.spec.nullable} for o in s.options]
               for s in loaded.schemes}
    targets = {t.name: [{"name": o.name, "type": o.spec.type, "default": o.spec.default, "doc": o.spec.help}
                        for o in t.options] for t in loaded.targets}
    if as_json:
        _emit_json({"plugins": rows, "scheme_options": schemes, "target_options": targets})
        return
    for info in loaded.info:
        click.echo(f"{info.name}  ({info.source})")
        for kind, names in info.registered.items():
            click.echo(f"    {kind}: {', '.join(names)}")
    _echo_options("scheme options (quant.<name>):", schemes)
    _echo_options("target options (target.<name>):", targets)


def _echo_options(title: str, owners: dict[str, list[dict[str, Any]]]) -> None:
    click.echo(title)
    for owner, options in owners.items():
        if options:  # defaults as JSON, which is how a recipe spells them: null / true / 64 / "minmax"
            click.echo(f"    {owner}: " + ", ".join(f"{o['name']} ({o['type']}, default {json.dumps(o['default'])})"
                                            for o in options))


def _interrupt_on_signals() -> None:
    """SIGTERM unwinds like Ctrl-C, so temp files are removed and no half-written output is left; both also set
    `INTERRUPTED`, which every file commit checks (an interrupt Python drops inside a `__del__` still stops it)."""
    import os
    import signal
    import threading

    from topq.io.files import INTERRUPTED

    def handler(signum: int, frame: object, owner: int = os.getpid()) -> None:
        if os.getpid() != owner:  # a pool worker forked before its start-up reset this handler: end quietly
            os._exit(128 + signum)
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        INTERRUPTED.clear()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, turning every expected failure into one line on stderr."""
    _interrupt_on_signals()
    try:
        cli.main(args=argv, prog_name="topq", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return exc.exit_code
    except TopqError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        return 1
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130
    except MemoryError:
        click.echo("error: out of memory", err=True)
        return 1
    except OSError as exc:  # the file system refused (full, read-only, vanished): say what and where
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"error: {where}{exc.strerror or exc}", err=True)
        return 1
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
