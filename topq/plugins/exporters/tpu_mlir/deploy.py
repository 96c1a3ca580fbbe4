"""Drive TPU-MLIR's own tools (model_deploy.py, model_runner.py, model_tool) from topq's Python.

TPU-MLIR needs CPython 3.10, so it lives in its own venv (scripts/setup-tpu-mlir.sh) and is run as
subprocesses of that venv's interpreter. A failing tool is one TopqError showing the end of its log.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from topq.core.progress import progress_bar
from topq.ir.errors import TopqError

ENV_VAR = "TOPQ_TPU_MLIR"
LOG_TAIL_LINES = 12


@dataclass(frozen=True)
class TpuMlir:
    """A TPU-MLIR installation: the venv's python; the tools are console scripts beside it."""

    python: Path

    def tool(self, name: str) -> Path:
        return self.python.parent / name


def find_tpu_mlir(option: str | None) -> TpuMlir | None:
    """The installation named by `--tpu-mlir PYTHON` or $TOPQ_TPU_MLIR, or None when neither is set."""
    wanted = option or os.environ.get(ENV_VAR)
    if not wanted:
        return None
    python = Path(wanted).absolute()  # tools run in the net directories; not resolve(): a venv python is a symlink
    if python.is_dir():  # a venv directory is accepted too
        python = python / "bin" / "python"
    found = TpuMlir(python)
    if not python.exists() or not found.tool("model_deploy.py").exists():
        raise TopqError(f"{wanted}: not a TPU-MLIR python (no model_deploy.py beside it); "
                        "set it up with: bash scripts/setup-tpu-mlir.sh")
    return found


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in lines[-LOG_TAIL_LINES:] if line.strip())


def run_tool(tpu: TpuMlir, tool: str, args: Sequence[str], cwd: Path, log_name: str) -> None:
    """Run one TPU-MLIR tool in `cwd`, its output in `cwd/log_name`; a failure raises with the log's end."""
    log = cwd / log_name
    command = [str(tpu.python), str(tpu.tool(tool)), *args] if tool.endswith(".py") else [str(tpu.tool(tool)), *args]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # topq's path must not shadow TPU-MLIR's own packages
    # its tools call one another by name (llm_convert.py runs model_deploy.py through GNU parallel)
    env["PATH"] = os.pathsep.join([str(tpu.python.parent), *filter(None, [env.get("PATH")])])
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              stdin=subprocess.DEVNULL, check=False).returncode
    if code != 0:
        raise TopqError(f"TPU-MLIR {tool} failed for {cwd.name} (exit {code}, log {log}): {_tail(log)}")


def deploy_all(tpu: TpuMlir, jobs: Sequence[tuple[Path, list[str]]], workers: int, progress: bool) -> None:
    """Run model_deploy.py for each (net directory, arguments) in parallel; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(run_tool, tpu, "model_deploy.py", args, cwd, "deploy.log"): cwd for cwd, args in jobs}
        bar = progress_bar(total=len(futures), desc="model_deploy", unit="net", disable=not progress)
        try:
            for future in as_completed(futures):
                future.result()
                bar.update(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            bar.close()


def combine(tpu: TpuMlir, bmodels: Sequence[Path], output: Path) -> None:
    """`model_tool --combine` of every net's bmodel into one file."""
    run_tool(tpu, "model_tool", ["--combine", *[str(b) for b in bmodels], "-o", str(output)], output.parent,
             "combine.log")


def run_bmodel(tpu: TpuMlir, bmodel: Path, inputs: Mapping[str, np.ndarray], work_dir: Path) -> dict[str, np.ndarray]:
    """Run one compiled net on TPU-MLIR's simulator (model_runner.py, cmodel); outputs by name, as float32."""
    work_dir.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v) for k, v in inputs.items()}
    np.savez(work_dir / "runner_input.npz", **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds badly
    run_tool(tpu, "model_runner.py", ["--input", "runner_input.npz", "--model", str(bmodel.resolve()),
                                      "--output", "runner_output.npz"], work_dir, "runner.log")
    with np.load(work_dir / "runner_output.npz") as out:
        return {name: np.asarray(out[name], dtype=np.float32) for name in out.files}
