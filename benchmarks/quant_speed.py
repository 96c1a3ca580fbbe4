"""Quantization speed and memory next to quality: GPTQ act-order, AWQ, AutoRound, int8 mixed precision on
SmolLM2-135M, one table (method, tool, perplexity, seconds, peak RSS).

    cd /work/main && python -m benchmarks.quant_speed                                    # the issue's setting
    cd /work/main && python -m benchmarks.quant_speed --samples 4 --seq-len 256 --eval-windows 1 --iters 20
    python -m benchmarks.quant_speed --rows gptq,awq --baseline /path/to/other/checkout   # before / after

Setting (shared with benchmarks/quant_quality.py): calibration `--samples` × `--seq-len` tokens of
00_EMMA.txt, perplexity on the first `--eval-windows` × `--window` tokens of 03_Persuasion.txt, 4-bit group 64
asymmetric, lm_head bf16; int8 mixed precision with SmoothQuant α = 0.5 and a perplexity budget of 1.03 × bf16 on
held-out calibration text. Each conversion runs in a child process of its own: "seconds" is its wall time (model read,
calibration, solve, bundle), "peak RSS" the largest of the child's own and its workers' (`benchmarks/peak_rss.py`:
not `ru_maxrss`, which would start at this process's peak); perplexity is measured after, in this process, on the
bundle.

Peers: llm-compressor (GPTQ with static act-order, AWQ) and auto-round run in their own Python, `--peer-python`
(default `.venv-peers/bin/python`, made by `bash benchmarks/setup_peers.sh`: llm-compressor pins another
transformers than topq's). They are not topq's dependencies. Each peer run is a child process
(`benchmarks/peer_quant.py`) given the GGUF, the calibration windows topq sampled and the evaluation ids, so both
tools see the same tokens; its seconds are load + quantize, its perplexity is computed by transformers on its
fake-quantized float32 model. Without that Python the peer rows say `not installed`.
The kernel line says which BLAS ran; note the load average printed beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.peak_rss import own_peak_mib  # noqa: E402
from benchmarks.quant_quality import add_setting_arguments, build_recipe  # noqa: E402

#: row key → (method, scheme, extra quant options); AutoRound's steps come from --iters
ROWS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gptq": ("GPTQ act-order", "gptq", {"act_order": True}),
    "gptq-static": ("GPTQ act-order, static groups", "gptq", {"act_order": True, "static_groups": True}),
    # as llm-compressor keeps a float32 model: scales and lm_head in float32 (topq's default is bf16 for both)
    "gptq-static-f32": ("GPTQ act-order, static, f32 scales + lm_head", "gptq",
                        {"act_order": True, "static_groups": True, "act_dtype": "f32", "lm_head": "f32"}),
    "gptq-static-f32-mse": ("GPTQ act-order, static, f32, MSE ranges", "gptq",
                            {"act_order": True, "static_groups": True, "act_dtype": "f32", "lm_head": "f32",
                             "scale_search": "mse"}),
    # the same with the calibration forwards' linears and Hessian sums in torch bf16 (topq.ir.products)
    "gptq-static-f32-mse-bf16": ("GPTQ act-order, static, f32, MSE ranges, bf16 products", "gptq",
                                 {"act_order": True, "static_groups": True, "act_dtype": "f32", "lm_head": "f32",
                                  "scale_search": "mse", "calibration_matmul": "bf16"}),
    "awq": ("AWQ (scale + clip)", "awq", {"clip": True}),
    "awq-bf16": ("AWQ (scale + clip), bf16 products", "awq", {"clip": True, "calibration_matmul": "bf16"}),
    "autoround": ("AutoRound", "autoround", {}),
    "autoround-bf16": ("AutoRound, bf16 products", "autoround", {"calibration_matmul": "bf16"}),
    # the block objective (every linear of a layer on the layer's output, auto-round's) and the per-linear one
    "autoround-block-bf16": ("AutoRound block objective, bf16 products", "autoround",
                             {"calibration_matmul": "bf16", "objective": "block"}),
    # as auto-round's model is evaluated in float32 (fake-quantized): scales and lm_head in float32
    "autoround-block-f32-bf16": ("AutoRound block objective, f32 scales + lm_head, bf16 products", "autoround",
                                 {"calibration_matmul": "bf16", "objective": "block", "act_dtype": "f32",
                                  "lm_head": "f32"}),
    # the same with float32 products: the row for a CPU without bf16 instructions (AVX2 only), where torch's bf16
    # products are 30-100x slower than float32 (docs/speed.md)
    "autoround-block-f32": ("AutoRound block objective, f32 scales + lm_head", "autoround",
                            {"objective": "block", "act_dtype": "f32", "lm_head": "f32"}),
    "autoround-linear-bf16": ("AutoRound per linear, bf16 products", "autoround",
                              {"calibration_matmul": "bf16", "objective": "linear"}),
    # the row (docs/quantization.md's int8 table): the budget on held-out EMMA is tighter than the 1.05 ×
    # float the row is judged by on Persuasion
    "int8": ("INT8 mixed, SmoothQuant 0.5, budget 1.03", "int8",
             {"observer": "minmax", "smooth_alpha": 0.5, "budget": 1.03}),
}
# row key → (peer tool, its module, peer_quant.py's method); llm-compressor's GPTQ default is `actorder: static`,
# on a float32 model: the gptq-static-f32 row (and with its mse observer, the -mse row). A -bf16 row has its
# float32 row's peer; a run quantizes with each peer method once, under the first row that names it.
PEERS = {"gptq-static-f32": ("llm-compressor", "llmcompressor", "gptq"),
         "gptq-static-f32-mse": ("llm-compressor", "llmcompressor", "gptq-mse"),
         "awq": ("llm-compressor", "llmcompressor", "awq"),
         "autoround": ("auto-round", "auto_round", "autoround")}
PEERS |= {f"{key}-bf16": peer for key, peer in PEERS.items() if f"{key}-bf16" in ROWS}
PEERS |= {key: PEERS["autoround"] for key in ROWS if key.startswith("autoround-")}  # every AutoRound row: auto-round
PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def convert_one(args: argparse.Namespace) -> int:
    """Child: convert one row's bundle (`--one KEY --out PATH`)."""
    from topq.core.pipeline import convert

    _, scheme, quant = ROWS[args.one]
    quant = dict(quant)
    if scheme == "autoround":
        quant["iters"] = args.iters
    if scheme == "int8":
        quant["table"] = str(Path(args.out).with_suffix(".table.yaml"))
    convert(build_recipe(args, scheme, Path(args.out), **quant), progress=False, jobs=args.jobs)
    print(json.dumps({"peak_rss_mib": own_peak_mib()}))  # the last line of stdout: what the parent reads
    return 0


def run_child(args: argparse.Namespace, key: str, out: Path, root: Path = ROOT) -> dict[str, Any]:
    """Convert in a child process running topq from the checkout `root` (and this benchmark's own code); its wall
    time and peak RSS (MiB: the largest of the child and its calibration workers)."""
    # topq is imported from `root` before this file's directory goes first on sys.path: its submodules then come
    # from root's package whatever sys.path says later
    program = (f"import sys; sys.path.insert(0, {str(root)!r}); import topq; sys.path.insert(0, {str(ROOT)!r}); "
               "from benchmarks.quant_speed import main; raise SystemExit(main(sys.argv[1:]))")
    argv = [sys.executable, "-c", program, "--one", key, "--out", str(out),
            *(f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
              if name in SETTING and value is not None)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    started = time.perf_counter()
    with tempfile.TemporaryFile() as stdout:
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE)
        assert child.stderr is not None
        err = child.stderr.read()
        _, status, _ = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise SystemExit(f"{key}: conversion failed ({child.returncode}):\n{err.decode(errors='replace')[-2000:]}")
        stdout.seek(0)
        measured = json.loads(stdout.read().decode().strip().splitlines()[-1])
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(measured["peak_rss_mib"], 1)}


def peer_importable(python: Path, module: str) -> bool:
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


def calibration_tokens(args: argparse.Namespace, out_dir: Path) -> np.ndarray:
    """The calibration windows topq's conversions read (the same recipe setting), for the peers."""
    from topq.core.pipeline import load_model
    from topq.quant.calibration import calibration_windows

    recipe = build_recipe(args, "gptq", out_dir / "windows.topq")
    return calibration_windows(load_model(recipe), recipe, progress=False)


def model_file(model: str) -> str:
    """The GGUF's path for the peers (`pkg:` paths name a file inside an installed package)."""
    from topq.io.files import package_file

    return package_file(model) if model.startswith("pkg:") else model


def run_peer(args: argparse.Namespace, method: str, windows: Path, ids: Path) -> dict[str, Any]:
    """One peer quantization in the peers' Python: its perplexity, load + quantize seconds and peak RSS."""
    argv = [str(args.peer_python), str(ROOT / "benchmarks" / "peer_quant.py"), "--method", method,
            "--model", model_file(args.model), "--hf-dir", str(windows.parent / "peer-model"),
            "--windows", str(windows), "--eval", str(ids), "--window", str(args.window),
            "--iters", str(args.peer_iters)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.jobs)}  # torch's threads: as many as topq's jobs
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err)
        _, status, _ = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if child.returncode != 0:
            raise SystemExit(f"{method} ({args.peer_python}): failed ({child.returncode}):\n"
                             f"{err.read().decode(errors='replace')[-3000:]}")
        result = json.loads(out.read().decode().strip().splitlines()[-1])
    return {"perplexity": round(result["perplexity"], 3), "seconds": round(result["seconds"], 1),
            "peak_rss_mib": round(result["peak_rss_mib"], 1)}


SETTING = ("model", "calibration", "eval_text", "samples", "seq_len", "seed", "eval_windows", "window", "iters",
           "jobs")


def eval_ids(args: argparse.Namespace, bundle: Any) -> list[int]:
    needed = args.eval_windows * args.window
    text = args.eval_text.read_text(encoding="utf-8")
    ids = list(bundle.tokenizer(text[:needed * 8], add_special_tokens=False)["input_ids"][:needed])
    if len(ids) < needed:
        raise SystemExit(f"{args.eval_text}: only {len(ids)} tokens, need {needed}")
    return ids


def log_row(row: dict[str, Any]) -> None:
    """One finished row on stderr, as it comes (a full run takes most of an hour)."""
    print(f"{row['method']:<40} {row['tool']}  ppl {row['perplexity']:8.3f}  {row['seconds']:8.1f} s  "
          f"{row['peak_rss_mib']:8.1f} MiB", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_setting_arguments(p)
    p.add_argument("--iters", type=int, default=200, help="AutoRound steps (default 200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="calibration worker processes, as `topq convert --jobs` (default: the CPU count, its default)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    p.add_argument("--out-dir", type=Path, help="keep bundles here (default: a temp dir)")
    p.add_argument("--baseline", type=Path, help="also convert each row with the topq of this checkout (the "
                   "reference run: same machine, same process, rows interleaved)")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                   help="the Python where llm-compressor / auto-round are installed (benchmarks/setup_peers.sh)")
    p.add_argument("--skip-peers", default="", help="comma-separated peer methods not to run (of "
                   + ", ".join(sorted({m for _, _, m in PEERS.values()})) + "; llm-compressor's awq takes hours "
                   "on a CPU)")
    p.add_argument("--peer-iters", type=int, default=50, help="auto-round's steps (the issue's peer row: 50)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--one", choices=sorted(ROWS), help=argparse.SUPPRESS)  # child mode
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.bits, args.group_size = 4, 64  # the setting (build_recipe reads them)
    if args.one:
        return convert_one(args)

    from topq.core.bundle import Bundle
    from topq.core.runtime import perplexity
    from topq.ir.threads import kernel_info, kernel_name

    keys = [k for k in args.rows.split(",") if k]
    unknown = sorted(set(keys) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    tmp = tempfile.TemporaryDirectory(prefix="topq-qs-")
    out_dir = args.out_dir or Path(tmp.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    ids: list[int] | None = None
    peer_files: tuple[Path, Path] | None = None  # calibration windows and eval ids for the peers (.npy)
    peers_run = {m for m in args.skip_peers.split(",") if m}  # a method in it is not run (again)
    runs = [("topq", ROOT)] + ([("topq baseline", args.baseline.resolve())] if args.baseline else [])
    for key in keys:
        method = ROWS[key][0] + (f" ({args.iters} steps)" if ROWS[key][1] == "autoround" else "")
        for tool, root in runs:
            out = out_dir / f"{key}-{tool.replace(' ', '-')}.topq"
            measured = run_child(args, key, out, root)
            bundle = Bundle(out)
            ids = ids or eval_ids(args, bundle)
            ppl, _ = perplexity(bundle, ids, window=args.window)
            rows.append({"method": method, "tool": tool, "perplexity": round(ppl, 3), **measured})
            log_row(rows[-1])
        if key in PEERS and PEERS[key][2] not in peers_run:
            tool, module, peer_method = PEERS[key]
            peers_run.add(peer_method)
            # the peer's own setting: float32 products; auto-round with its defaults and --peer-iters
            method = f"AutoRound ({args.peer_iters} iters)" if ROWS[key][1] == "autoround" else \
                ROWS[key][0].removesuffix(", bf16 products")
            if not peer_importable(args.peer_python, module):
                rows.append({"method": method, "tool": tool, "perplexity": None, "seconds": None,
                             "peak_rss_mib": None, "note": "not installed"})
                continue
            if peer_files is None:
                assert ids is not None
                peer_files = (out_dir / "windows.npy", out_dir / "eval.npy")
                np.save(peer_files[0], calibration_tokens(args, out_dir).astype(np.int32))
                np.save(peer_files[1], np.asarray(ids, dtype=np.int32))
            measured = run_peer(args, peer_method, *peer_files)
            rows.append({"method": method, "tool": tool, **measured})
            log_row(rows[-1])
    report = {"setting": {name: str(getattr(args, name)) for name in SETTING}, "kernel": kernel_info(),
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": rows}
    tmp.cleanup()
    if args.json:
        print(json.dumps(report))
        return 0
    for k in report["kernel"]:
        print(f"kernel: {kernel_name(k)}, {k['num_threads']} threads")
    print(f"SmolLM2-135M, calibration {args.samples} x {args.seq_len} EMMA, eval {args.eval_windows} x {args.window} "
          f"Persuasion, w4 g64 asym; --jobs {args.jobs} (one BLAS thread each); load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"| {'method':<40} | {'tool':<14} | perplexity | seconds | peak RSS MiB |")
    print(f"|{'-' * 42}|{'-' * 16}|-----------:|--------:|-------------:|")
    for r in rows:
        if r["perplexity"] is None:
            tool = f"{r['tool']} ({r['note']})"
            print(f"| {r['method']:<40} | {tool:<14} | {'-':>10} | {'-':>7} | {'-':>12} |")
            continue
        print(f"| {r['method']:<40} | {r['tool']:<14} | {r['perplexity']:10.3f} | {r['seconds']:7.1f} | "
              f"{r['peak_rss_mib']:12.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
