"""What the planner knows of one accelerator (or of this machine): a catalog entry or a measurement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or this machine). All rates are per device."""

    name: str
    memory_bytes: float  # as the device reports it (nvidia-smi's total), not as marketed
    bandwidth_bytes_per_s: float
    bf16_flops: float  # dense tensor-core FLOP/s (a CPU: its measured fp32 GEMM rate)
    fp8_flops: float | None  # None: no fp8 units, fp8 weights run in bf16
    int8_ops: float | None
    price_per_hour: float  # default $/device-hour
    notes: str = ""
    measured: bool = False

    def peak_flops(self, compute: str) -> float:
        """Peak rate for a compute class from dtypes.compute_class, falling back to bf16."""
        rate = {"fp8": self.fp8_flops, "int8": self.int8_ops}.get(compute)
        return rate if rate else self.bf16_flops
