"""kill -9 of a conversion (issue 16): its pool workers die with it, a killed worker is one error line, and the
temp file a killed write leaves is removed by the next write of the same output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from smol_model import SMOL_RECIPE_PATH

SMOL_W4 = ["--set", f"model.path={SMOL_RECIPE_PATH}", "--set", "quant.scheme=w4bf16", "--set", "target.chip=bm1684x",
           "--set", "stages.seq_length=256", "--set", "stages.max_input_length=64", "--set", "stages.decode_chunks=[]"]


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def start_convert(tmp_path: Path, output: Path, *extra: str) -> subprocess.Popen[bytes]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: x}}\noutput: {{path: {output}}}\n")
    return subprocess.Popen([sys.executable, "-m", "topq.core.cli", "convert", str(recipe), *SMOL_W4, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_workers_die_with_a_killed_conversion(tmp_path: Path) -> None:
    proc = start_convert(tmp_path, tmp_path / "out.topq", "--jobs", "2", "--no-cache")
    try:
        workers = wait_for(lambda: children(proc.pid), 300, "pool workers")
        assert isinstance(workers, set)
        time.sleep(0.5)
        workers |= children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(w) for w in workers):
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)], "pool workers outlived their killed parent"
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_worker_is_one_error_line(tmp_path: Path) -> None:
    output = tmp_path / "out.topq"
    proc = start_convert(tmp_path, output, "--jobs", "2", "--no-cache")
    try:
        workers = wait_for(lambda: children(proc.pid), 300, "pool workers")
        assert isinstance(workers, set)
        os.kill(min(workers), signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    text = err.decode()
    assert proc.returncode != 0
    assert "Traceback" not in text and "error: a conversion worker process died" in text, text[-2000:]
    assert not output.exists() and not list(tmp_path.glob(".out.topq.*"))


def test_a_worker_forked_with_the_clis_handlers_ends_quietly_on_sigterm() -> None:
    """The pool can stop a worker before its start-up resets the handlers it inherited from the CLI (the race
    behind a `Process ForkProcess-2: Traceback … KeyboardInterrupt` on stderr): the inherited handler then exits
    the worker quietly instead of raising KeyboardInterrupt in it; the parent still gets KeyboardInterrupt."""
    script = (
        "import os, signal, sys, time\n"
        "from topq.core.cli import _interrupt_on_signals\n"
        "_interrupt_on_signals()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
        "os.kill(child, signal.SIGTERM)\n"
        "_, status = os.waitpid(child, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    print('parent interrupted')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == [str(128 + signal.SIGTERM), "parent interrupted"], done
    assert done.stderr == "", done.stderr


def test_stale_temp_file_of_a_killed_write_is_removed(tmp_path: Path) -> None:
    output = tmp_path / "out.topq"
    proc = start_convert(tmp_path, output, "--jobs", "1", "--no-cache")
    try:
        temp = wait_for(lambda: list(tmp_path.glob(".out.topq.*.tmp")), 300, "the bundle's temp file")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert isinstance(temp, list) and all(p.exists() for p in temp) and not output.exists()
    again = start_convert(tmp_path, output, "--jobs", "1")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err.decode()[-2000:]
    assert output.exists() and not list(tmp_path.glob(".out.topq.*"))


@pytest.mark.parametrize("writer_alive", [True, False])
def test_only_dead_writers_temp_files_are_removed(tmp_path: Path, writer_alive: bool) -> None:
    import numpy as np

    from topq.io.safetensors import write_safetensors

    pid = os.getpid() if writer_alive else 2**22 + 12345  # above the kernel's pid_max: no such process
    stale = tmp_path / f".out.topq.{pid}-abc123.tmp"
    stale.write_bytes(b"partial")
    write_safetensors(tmp_path / "out.topq", {"x": np.zeros(3, np.float32)})
    assert stale.exists() == writer_alive
