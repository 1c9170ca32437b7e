"""Hardware catalog: per-device datasheet figures and default rental prices.

Figures are NVIDIA datasheet values for ONE device, dense (the datasheets' headline tensor
numbers assume 2:4 structured sparsity and are twice these). Memory is the datasheet capacity in
decimal GB; the driver-visible capacity of the 80/141 GB parts is about the same number in GiB
(~7% more), which makes the planner's largest batch slightly conservative. Prices are rough
on-demand $/device-hour at specialised GPU clouds in 2025 (hyperscalers charge more, spot and
commitments less): defaults to override with --price-per-hour, not quotes.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import PlanError
from .hardware import HardwareSpec

TB = 1e12
GB = 1e9


CATALOG: dict[str, HardwareSpec] = {
    "a100-80gb": HardwareSpec(
        "A100-80GB", 80 * GB, 2.039 * TB, 312 * TB, None, 624 * TB, 1.80,
        "A100 80GB SXM4 datasheet; no fp8 units"),
    "h100-sxm": HardwareSpec(
        "H100-SXM", 80 * GB, 3.35 * TB, 989.4 * TB, 1978.9 * TB, 1978.9 * TB, 3.00,
        "H100 SXM5 80GB datasheet"),
    "h200": HardwareSpec(
        "H200", 141 * GB, 4.8 * TB, 989.4 * TB, 1978.9 * TB, 1978.9 * TB, 3.80,
        "H200 SXM 141GB datasheet; H100 compute, more and faster HBM3e"),
    "l4": HardwareSpec(
        "L4", 24 * GB, 300 * GB, 121 * TB, 242.5 * TB, 242.5 * TB, 0.80,
        "L4 24GB GDDR6 datasheet (72 W)"),
    "l40s": HardwareSpec(
        "L40S", 48 * GB, 864 * GB, 362.05 * TB, 733 * TB, 733 * TB, 1.20,
        "L40S 48GB GDDR6 datasheet"),
    "b200": HardwareSpec(
        "B200", 180 * GB, 8 * TB, 2250 * TB, 4500 * TB, 4500 * TB, 6.00,
        "HGX/DGX B200 per-GPU figures (180 GB, 1000 W); standalone B200 lists 192 GB"),
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
