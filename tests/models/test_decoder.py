import pytest
import torch
import torch.nn.functional as F

from tokenmill.models import kernels
from tokenmill.models.decoder import rms_norm_kernel


@pytest.mark.parametrize("width", [640, 576, 72, 13, 256])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_kernel_equals_torch(width: int, offset: float) -> None:
    """The C norm sums x² in vector chains with a scalar tail (widths that are and are not multiples
    of 32 and of 8), on rows of ordinary and of very large values."""
    assert kernels.supports(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=gen)
    x[3] *= 1e15
    w = torch.randn(width, generator=gen)
    got = rms_norm_kernel(x, w, 1e-6, offset)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), offset + w, 1e-6), atol=1e-5, rtol=1e-5)
