"""The hardware catalog counts memory as the devices report it, not as it is marketed."""

from __future__ import annotations

import pytest

from tokenmill.plan.catalog import CATALOG

# The capacity on the box, in the marketing's GB. What the device reports (nvidia-smi's
# memory.total) is more bytes than that many decimal GB and at most that many GiB.
MARKETED_GB = {"a100-80gb": 80, "h100-sxm": 80, "h200": 141, "l4": 24, "l40s": 48, "b200": 180}


def test_every_entry_has_a_marketed_capacity() -> None:
    assert set(MARKETED_GB) == set(CATALOG)


@pytest.mark.parametrize("name", sorted(MARKETED_GB))
def test_memory_is_the_device_reported_capacity(name: str) -> None:
    hw, gb = CATALOG[name], MARKETED_GB[name]
    assert gb * 1e9 < hw.memory_bytes <= gb * 2**30
    assert "nvidia-smi" in hw.notes  # where the figure comes from, stated in the entry
