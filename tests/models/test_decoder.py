from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_equivalence import _tiny_model
from tokenmill.models import kernels
from tokenmill.models.build import build_model
from tokenmill.models.decoder import MLP, Attention, CausalLM, RMSNorm
from tokenmill.models.fused import FusedAttention, FusedCausalLM, FusedMLP, FusedRMSNorm, rms_norm_kernel
from tokenmill.models.loader import load_weights


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


def test_the_kernels_are_swapped_in_when_the_model_is_built_where_they_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU fp32 with the kernels built: every norm (q/k norms too), attention and gated MLP is the
    fused one. Elsewhere (bf16; no compiler) the model is decoder.py's, untouched."""
    _tiny_model("qwen3").save_pretrained(tmp_path)
    cpu, fused_types = torch.device("cpu"), {RMSNorm: FusedRMSNorm, Attention: FusedAttention, MLP: FusedMLP}

    def kinds(model: CausalLM) -> set[type]:
        return {type(m) for m in model.modules() if isinstance(m, tuple(fused_types))}

    fused = build_model(load_weights(str(tmp_path)), 64, cpu, torch.float32)
    assert type(fused) is FusedCausalLM and kinds(fused) == set(fused_types.values())
    bf16 = build_model(load_weights(str(tmp_path), dtype=torch.bfloat16), 64, cpu, torch.bfloat16)
    monkeypatch.setattr(kernels, "supports", lambda device, dtype: False)  # no compiler, say
    plain = build_model(load_weights(str(tmp_path)), 64, cpu, torch.float32)
    for model in (bf16, plain):
        assert type(model) is CausalLM and kinds(model) == set(fused_types)
