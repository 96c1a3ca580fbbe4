"""A process's own peak RSS, for benchmarks that run each measured job in a child process.

Not `ru_maxrss`: Linux carries the high-water mark of the memory a process had before its `exec` into it, so the
child of a benchmark that holds (or once held) a model starts at the parent's peak. A `python -c pass` child of a
parent that had touched 1 GiB and freed it reports 1,051 MiB against 27 before (docs/speed.md, twenty-second round).
`VmHWM` (/proc/self/status) is the mark of what the process mapped since its exec.

`topq convert`'s phase report measures the same way (`topq.core.pipeline.PhaseTimer`); this copy is the benchmarks'
own because the processes it measures cannot import today's topq: a `--baseline` checkout's conversion, and the
peers' Python.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path


def own_peak_mib() -> float:
    """This process's peak RSS since its exec, or that of a child process it has waited for if larger (children
    forked after the exec start from this process's own mark), MiB. Linux only."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    if found is None:
        raise RuntimeError("no VmHWM in /proc/self/status (the benchmarks' peak RSS needs Linux)")
    return max(int(found.group(1)), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
