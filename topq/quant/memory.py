"""The C allocator's handling of large freed blocks, for loops that allocate the same large temporaries again and
again (the calibration layer loop: activations of [batch, L, H], torch's forward and backward buffers).

glibc serves a block above its mmap threshold (128 KiB at first, raised dynamically up to 32 MiB) with a fresh
mmap and gives it back to the kernel when it is freed; each new block then page-faults on every 4 KiB page it
touches, which under a hypervisor can cost more than the arithmetic. On a KVM guest, one AutoRound block step
(4 × 512 tokens of SmolLM2, forward and backward, run alone) took 274 ms with the defaults and 235 ms with freed
blocks kept; its gated multiply had taken 19 ms against 0.6 ms timed alone. In a whole calibration run the gain was
within noise, probably because glibc's dynamic threshold already keeps most such blocks there (docs/speed.md, tenth
round). Peak RSS is what the largest step holds either way; the heap just does not shrink back between steps.

A freed block goes back to the arena it came from, and glibc gives each thread an arena of its own (up to 8 per
core): with blocks kept, every arena then stays at the largest step its own thread ever ran, and the process's RSS
at the sum of those instead of the largest step. So the setting also puts every thread on one arena, where a block
one task thread freed serves the next thread's step (the AWQ row with bf16 products: 1,610 -> 1,487 MiB RSS at the
same heap high-water; docs/speed.md, twenty-second round). The price is one lock per allocation, which the
threads then share: AutoRound's rows, whose torch steps allocate many small blocks on two threads, ran at
1.01-1.09x the time with one arena, within this machine's spread between runs.

Numerics are untouched (only where buffers live changes). A process-wide setting (glibc has no per-thread or
scoped form), applied once; elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: blocks up to this size come from the heap (glibc's largest mmap threshold on 64-bit: HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 << 20
#: free memory the heap keeps before it gives any back to the kernel
TRIM_THRESHOLD = 1 << 30
#: arenas threads allocate from (threads already attached to another arena keep it: apply before starting them)
ARENAS = 1


@functools.cache
def keep_freed_memory() -> bool:
    """Let this process's threads reuse freed large blocks, whichever thread freed them, instead of mapping fresh
    pages for each (see the module doc); whether the allocator took the setting."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: another libc's mallopt takes other parameters)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_ARENA_MAX, ARENAS)))
