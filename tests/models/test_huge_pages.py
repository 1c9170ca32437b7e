import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill.models.huge_pages import HUGE_PAGE, huge_page_empty, move_to_huge_pages
from tokenmill.models.quant import QuantizedLinear, kernel_available, quantize


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 512)
        self.head = nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight  # tied, as a small model's output layer often is
        self.norm = nn.Parameter(torch.randn(512))
        self.register_buffer("table", torch.randn(64, 512), persistent=False)  # made at load, not a weight
        self.quantized = QuantizedLinear(quantize(torch.randn(1024, 512) * 0.05, 8))


@pytest.mark.skipif(not kernel_available(), reason="the quantised kernels did not build here")
def test_weights_move_with_their_values_ties_and_kernel_pointers() -> None:
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(3, 512)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    y_before = model.quantized(x)
    table = model.table.data_ptr()

    moved = move_to_huge_pages(model)

    state = model.state_dict()
    assert moved >= sum(t.nbytes for name, t in state.items() if name != "head.weight")
    for name, value in before.items():
        assert torch.equal(state[name], value), name
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still one tensor
    with torch.no_grad():
        model.embed.weight[5, 7] = 42.0
    assert model.head.weight[5, 7] == 42.0
    assert min(t.data_ptr() for t in state.values()) % HUGE_PAGE == 0  # the arena starts on a huge page
    assert model.table.data_ptr() == table  # not a weight: left where it was
    # The kernel reads the moved blocks: its cached pointers follow them.
    assert model.quantized._pointers[0] == model.quantized.weight.data_ptr()
    assert torch.equal(model.quantized(x), y_before)


def test_too_little_to_fill_a_huge_page_stays_put() -> None:
    small = nn.Linear(64, 64)
    pointer = small.weight.data_ptr()
    assert move_to_huge_pages(small) == 0
    assert small.weight.data_ptr() == pointer
    assert huge_page_empty((64, 64), torch.float32).shape == (64, 64)


@pytest.mark.skipif(not (hasattr(mmap, "MADV_HUGEPAGE") and Path("/proc/self/smaps").exists()),
                    reason="no transparent huge pages on this OS")
def test_big_tensors_live_in_mappings_advised_for_huge_pages() -> None:
    cache = huge_page_empty((3, HUGE_PAGE // 4), torch.float32)
    assert cache.shape == (3, HUGE_PAGE // 4) and cache.dtype == torch.float32
    assert cache.data_ptr() % HUGE_PAGE == 0
    cache.fill_(1.0)
    # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages. (No negative control against
    # torch.empty: in the full suite glibc served one from a heap mapping already flagged so.)
    assert "hg" in _vm_flags(cache.data_ptr())
