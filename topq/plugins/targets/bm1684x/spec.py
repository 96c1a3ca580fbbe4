"""Chip specs of the BM1684X family, as data. A new chip of the family is a new `ChipSpec`, not new code."""

from __future__ import annotations

from dataclasses import dataclass, field

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@dataclass(frozen=True)
class ChipSpec:
    name: str
    lanes: int  # NPU lanes
    local_mem_per_lane: int  # bytes of local memory per lane
    local_mem_banks: int
    eu_bytes: int  # bytes one execution unit processes per cycle per lane
    peak_ops: dict[str, float]  # per core: ops/s by compute dtype (bf16, f16, int8, f32); a MAC is 2 ops
    ddr_bandwidth: float  # bytes/s per core (read)
    clock_hz: float
    dma_align: int  # bytes: DMA burst alignment
    global_align: int  # bytes: alignment of global (DDR) tensors
    ddr_size: int  # bytes
    cores: int = 1
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def local_mem(self) -> int:
        return self.lanes * self.local_mem_per_lane


BM1684X = ChipSpec(
    name="bm1684x",
    lanes=64,
    local_mem_per_lane=256 * KiB,
    local_mem_banks=16,
    eu_bytes=64,
    peak_ops={"bf16": 16.4e12, "f16": 16.4e12, "int8": 32.8e12, "f32": 2.05e12},
    ddr_bandwidth=64e9,
    clock_hz=1e9,
    dma_align=512,
    global_align=4096,
    ddr_size=16 * GiB,
)

BM1688 = ChipSpec(
    name="bm1688",
    lanes=32,
    local_mem_per_lane=128 * KiB,
    local_mem_banks=16,
    eu_bytes=16,
    # Per core (2 cores). Public figures: 16 TOPS INT8 for the chip; BF16/F16 at half the INT8 rate.
    peak_ops={"bf16": 4.0e12, "f16": 4.0e12, "int8": 8.0e12, "f32": 0.5e12},
    ddr_bandwidth=24e9,
    clock_hz=1e9,
    dma_align=512,
    global_align=4096,
    ddr_size=8 * GiB,
    cores=2,
    notes={"ddr_bandwidth": "simulation default: ~24 GB/s DDR read per core"},
)

SPECS: dict[str, ChipSpec] = {spec.name: spec for spec in (BM1684X, BM1688)}
