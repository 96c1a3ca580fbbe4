"""keep_freed_memory: a freed large block is reused instead of mapped (and page-faulted) afresh."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_it_is_applied_once() -> None:
    from topq.quant.memory import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory()
