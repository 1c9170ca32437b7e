"""The CPU linear layers: the small-batch kernel and oneDNN packing against plain F.linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.reference import ReferenceCache
from tokenmill import LLM, SamplingParams
from tokenmill.engine import llm_engine
from tokenmill.models import kernels, packed
from tokenmill.models.loader import load_weights
from tokenmill.models.packed import SMALL_BATCH_ROWS, PackedLinear, blocked_weight, small_gemm


@pytest.mark.parametrize(("n", "k"), [(8, 4), (24, 20), (96, 68)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 19])
def test_small_gemm_matches_a_plain_matmul(n: int, k: int, rows: int) -> None:
    assert kernels.supports(torch.device("cpu"), torch.float32), "gcc is where CI runs"
    gen = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    torch.testing.assert_close(small_gemm(x, blocked_weight(w), b), x @ w.T + b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(small_gemm(x, blocked_weight(w), None), x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("onednn", [True, False])
def test_packed_linear_gives_f_linear_at_every_row_count(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(packed, "small_gemm", lambda *a: calls.append(a[0].shape[0]) or small_gemm(*a))
    linear = torch.nn.Linear(64, 40)
    layer = PackedLinear(linear, batch_hint=32, onednn=onednn, small_batch=True)
    for rows in (1, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 100):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, 3, SMALL_BATCH_ROWS], "the kernel serves small batches only"


def test_a_shape_or_dtype_the_kernel_cannot_take_falls_back() -> None:
    linear = torch.nn.Linear(64, 12)  # 12 output columns: not whole 8-column blocks
    layer = PackedLinear(linear, batch_hint=8, small_batch=True)
    assert layer.blocked is None
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    bf16 = PackedLinear(torch.nn.Linear(64, 16).bfloat16(), batch_hint=8, onednn=False, small_batch=True)
    assert bf16.blocked is None, "the kernel is fp32-only"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama: Path) -> ReferenceCache:
    from transformers import AutoModelForCausalLM

    return ReferenceCache(AutoModelForCausalLM.from_pretrained(tiny_llama).eval())


PROMPT, MAX_NEW = [5, 6, 7], 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _greedy(llm: LLM) -> list[int]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW
    return out.token_ids


def _uses_kernel(llm: LLM) -> bool:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert layers, "every linear is a PackedLinear on CPU"
    return all(m.blocked is not None for m in layers)


def test_auto_keeps_the_second_weight_copy_only_where_memory_allows(
    tiny_llama: Path, tiny_reference: ReferenceCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = load_weights(str(tiny_llama))
    packed_llm, plain_llm = LLM(weights=weights, num_kv_blocks=8), LLM(weights=weights, num_kv_blocks=8,
                                                                       small_batch_linear="off")
    assert _uses_kernel(packed_llm)
    assert not _uses_kernel(plain_llm)
    # the packed path's greedy tokens are transformers' (near-ties aside), and the unpacked path's
    tiny_reference.check(PROMPT, _greedy(packed_llm), "packed linears")
    tiny_reference.check(PROMPT, _greedy(plain_llm), "plain linears")
    monkeypatch.setattr(llm_engine, "free_memory", lambda device: 1024)  # the copy would not fit
    assert not _uses_kernel(LLM(weights=weights, num_kv_blocks=8))
    assert _uses_kernel(LLM(weights=weights, num_kv_blocks=8, small_batch_linear="kernel"))


def test_insisting_on_a_kernel_that_cannot_run_names_the_setting(
    tiny_llama: Path, tiny_reference: ReferenceCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = load_weights(str(tiny_llama))
    monkeypatch.setattr(kernels, "supports", lambda device, dtype: False)  # no compiler, say
    settings = (("small_batch_linear", "off"), ("decode_attention", "sdpa"), ("prefill_attention", "sdpa"))
    for setting, fallback in settings:
        with pytest.raises(ValueError, match=f"EngineConfig.{setting}='kernel' needs a CPU.*'{fallback}'"):
            LLM(weights=weights, num_kv_blocks=8, **{setting: "kernel"})
    llm = LLM(weights=weights, num_kv_blocks=8)  # "auto" falls back to PyTorch ops
    assert not (_uses_kernel(llm) or llm.engine.runner.paged_kernel or llm.engine.runner.prefill_kernel)
    tiny_reference.check(PROMPT, _greedy(llm), "PyTorch-ops fallback")  # transformers' greedy tokens
