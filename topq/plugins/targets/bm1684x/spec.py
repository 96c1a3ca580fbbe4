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
    ddr_bandwidth: float  # bytes/s of the DDR interface, shared by all cores
    clock_hz: float
    dma_align: int  # bytes: DMA burst alignment
    global_align: int  # bytes: alignment of global (DDR) tensors
    ddr_size: int  # bytes
    cores: int = 1
    dma_bandwidth: float | None = None  # bytes/s one core's DMA engine moves at most (None: ddr_bandwidth)
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
    # Per core: MACs per TIU cycle x 2 ops x 0.9 GHz, as TPU-MLIR's BM1688 cycle model times a matmul (one
    # `top.MatMul` compiled with `model_deploy.py --chip bm1688 --num_core 2 --debug`, its MM2 instructions in
    # compiler_profile_0.txt; `python -m benchmarks.cube_rate` reproduces it): int8 4096 MACs/cycle (32 lanes x
    # 32 IC x 4 OHOW), bf16/f16 1024 (a quarter of int8, not the half that the IC parallelism suggests), f32 128.
    # The same tool gives BM1684X 8192 bf16 MACs/cycle, i.e. its published 16.4 TFLOPS at 1 GHz.
    peak_ops={"bf16": 2 * 1024 * 0.9e9, "f16": 2 * 1024 * 0.9e9, "int8": 2 * 4096 * 0.9e9, "f32": 2 * 128 * 0.9e9},
    ddr_bandwidth=4266e6 * 8,  # one 64-bit LPDDR4X interface at 4266 MT/s for both cores: 34.1 GB/s
    clock_hz=0.9e9,
    dma_align=512,
    global_align=4096,
    ddr_size=8 * GiB,
    cores=2,
    dma_bandwidth=32e9,
    notes={
        "source": "TPU-MLIR 1.30 python/profile_helper/bm1688_defs.py (DMA_ARCH: 2 cores, 32 NPUs, 64-bit bus, "
                  "DDR 4266 MHz, DDR max 32 GB/s per core, TIU 900 MHz, GDMA 750 MHz) and python/utils/tpu_info.py "
                  "(ic_parallel 32, eu_bytes 16, 128 KiB local memory per lane)",
        "ddr_bandwidth": "the two cores share one DDR interface; each core's DMA alone reaches 32 GB/s",
        "peak_ops": "TPU-MLIR 1.30's BM1688 cycle model (libbackend_bm1688.so, model_deploy.py --debug -> "
                    "compiler_profile_0.txt): MM2 at 4096 int8 / 1024 bf16 and f16 / 128 f32 MACs per cycle "
                    "and core, the TIU at 900 MHz (benchmarks/cube_rate.py)",
    },
)

SPECS: dict[str, ChipSpec] = {spec.name: spec for spec in (BM1684X, BM1688)}
