"""Hardware catalog: per-device figures, each with its source in the entry's notes.

Rates are NVIDIA datasheet values for ONE device, dense (the datasheets' headline tensor numbers
assume 2:4 structured sparsity and are twice these).

Memory is the capacity the device itself reports, ``nvidia-smi --query-gpu=memory.total`` in MiB
(1 MiB = 2**20 bytes), not the marketing figure: an "80 GB" A100 reports 81920 MiB = 85.9e9 bytes,
an H100 81559 MiB = 85.5e9, a "141 GB" H200 143771 MiB = 150.8e9. These are the bytes an engine
sizes its KV cache from (vLLM: gpu_memory_utilization x the total CUDA reports, which is the
nvidia-smi total less a driver reservation of 0.5-1%, well inside the planner's reserve).

Prices are rough on-demand $/device-hour at specialised GPU clouds in 2025 (hyperscalers charge
more, spot and commitments less): defaults to override with --price-per-hour, not quotes.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import PlanError
from .hardware import HardwareSpec

TB = 1e12
GB = 1e9
MiB = 2**20


CATALOG: dict[str, HardwareSpec] = {
    "a100-80gb": HardwareSpec(
        "A100-80GB", 81920 * MiB, 2.039 * TB, 312 * TB, None, 624 * TB, 1.80,
        "A100 80GB SXM4 datasheet; no fp8 units; memory: nvidia-smi 81920 MiB"),
    "h100-sxm": HardwareSpec(
        "H100-SXM", 81559 * MiB, 3.35 * TB, 989.4 * TB, 1978.9 * TB, 1978.9 * TB, 3.00,
        "H100 SXM5 80GB datasheet; memory: nvidia-smi 81559 MiB"),
    "h200": HardwareSpec(
        "H200", 143771 * MiB, 4.8 * TB, 989.4 * TB, 1978.9 * TB, 1978.9 * TB, 3.80,
        "H200 SXM 141GB datasheet, H100 compute with more and faster HBM3e; "
        "memory: nvidia-smi 143771 MiB"),
    "l4": HardwareSpec(
        "L4", 23034 * MiB, 300 * GB, 121 * TB, 242.5 * TB, 242.5 * TB, 0.80,
        "L4 24GB GDDR6 datasheet (72 W); memory: nvidia-smi 23034 MiB"),
    "l40s": HardwareSpec(
        "L40S", 46068 * MiB, 864 * GB, 362.05 * TB, 733 * TB, 733 * TB, 1.20,
        "L40S 48GB GDDR6 datasheet; memory: nvidia-smi 46068 MiB"),
    "b200": HardwareSpec(
        "B200", 183359 * MiB, 8 * TB, 2250 * TB, 4500 * TB, 4500 * TB, 6.00,
        "HGX/DGX B200 per-GPU figures (180 GB, 1000 W); memory: nvidia-smi 183359 MiB"),
}

THIS_MACHINE = "this-machine"


def get_hardware(name: str, measure: Callable[[], HardwareSpec] | None = None) -> HardwareSpec:
    """Look up a catalog entry (case-insensitive) or measure ``this-machine``."""
    key = name.strip().lower()
    if key == THIS_MACHINE:
        if measure is None:
            from .measure import measure_this_machine

            measure = measure_this_machine
        return measure()
    if key not in CATALOG:
        known = ", ".join([*CATALOG, THIS_MACHINE])
        raise PlanError("hardware", f"unknown hardware {name!r} (known: {known})")
    return CATALOG[key]
