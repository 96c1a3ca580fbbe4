"""keep_freed_memory: a freed large block is reused instead of mapped (and page-faulted) afresh, by any thread; and
the benchmarks' peak RSS of a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: 20 times: three 16 MiB arrays alive at once, then freed (as a layer's step frees its buffers); the page faults
#: of the last 19 rounds (the first maps the pages)
PROGRAM = """
import json, resource, sys
import numpy as np
from topq.quant.memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
def round_():
    arrays = [np.ones(4 << 20, dtype=np.float32) for _ in range(3)]
    del arrays
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    round_()
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_freed_blocks_are_reused_not_faulted_in_again() -> None:
    default, kept = faults("default"), faults("keep")
    array_pages = (16 << 20) // 4096
    assert kept["took"] is True
    assert default["faults"] > array_pages  # glibc gives freed memory back to the kernel and maps it again
    assert kept["faults"] < array_pages // 4


#: one thread allocates three 16 MiB arrays and frees them, and stays alive (its arena stays its own); then another
#: thread allocates three: how much the process's RSS grew for them
ACROSS_THREADS = """
import json, re, sys, threading
import numpy as np
from topq.quant.memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
freed, finish, grew = threading.Event(), threading.Event(), []
def first():
    arrays = [np.ones(4 << 20, dtype=np.float32) for _ in range(3)]
    del arrays
    freed.set()
    finish.wait()
def second():
    before = rss()
    arrays = [np.ones(4 << 20, dtype=np.float32) for _ in range(3)]
    grew.append(rss() - before)
one = threading.Thread(target=first)
one.start()
freed.wait()
two = threading.Thread(target=second)
two.start()
two.join()
finish.set()
one.join()
print(json.dumps({"took": took, "grew": grew[0]}))
"""


def test_a_block_one_thread_freed_serves_another_thread() -> None:
    def grew(mode: str) -> dict[str, object]:
        run = subprocess.run([sys.executable, "-c", ACROSS_THREADS, mode], capture_output=True, text=True, check=True)
        return json.loads(run.stdout)

    default, kept = grew("default"), grew("keep")
    arrays = 3 * (16 << 20)
    assert kept["took"] is True
    assert default["grew"] >= arrays * 0.9  # fresh mappings for the second thread's arrays
    assert kept["grew"] < arrays // 8  # the first thread's freed blocks (one arena for both threads)


def test_it_is_applied_once() -> None:
    from topq.quant.memory import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory()


#: a parent that touched 256 MiB and freed it runs a child: the child's own peak against what wait4 says of it
PARENT_OF_A_SMALL_CHILD = """
import json, os, subprocess, sys
import numpy as np
block = np.ones(64 << 20, dtype=np.float32)
del block
child = subprocess.Popen([sys.executable, "-c", "import json; from benchmarks.peak_rss import own_peak_mib; "
                          "print(json.dumps(own_peak_mib()))"], stdout=subprocess.PIPE)
own = json.loads(child.stdout.read())
_, _, usage = os.wait4(child.pid, 0)
print(json.dumps({"own": own, "ru_maxrss": usage.ru_maxrss / 1024}))
"""


def test_the_benchmarks_peak_rss_is_the_childs_own_not_its_parents() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", PARENT_OF_A_SMALL_CHILD], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)}).stdout
    peak = json.loads(out)
    assert peak["ru_maxrss"] > 256  # the parent's mark, carried through the exec
    assert peak["own"] < 128  # a Python that imported nothing large
