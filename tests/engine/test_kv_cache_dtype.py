"""EngineConfig.kv_cache_dtype: fp16 by default where the C kernels run (half the bytes a token
costs, so a budget holds twice the tokens); a dtype the kernels cannot read runs on PyTorch ops."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_equivalence import _prompts
from tests.reference import TeacherForcedReference
from tokenmill import LLM, SamplingParams
from tokenmill.models import kernels
from tokenmill.models.loader import LoadedWeights

BUDGET = 64 * 1024  # bytes: a few blocks of the tiny model


def _cache(llm: LLM) -> tuple[torch.dtype, int]:
    k, v = llm.engine.runner.kv_caches[0]
    assert k.dtype == v.dtype
    return k.dtype, llm.engine.block_manager.num_free_blocks


def test_auto_is_fp16_where_the_kernels_run_and_a_budget_then_holds_twice_the_blocks(
    tiny_llama: tuple[LoadedWeights, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights, _ = tiny_llama
    budget = {"block_size": 4, "kv_cache_bytes": BUDGET}
    half_dtype, half_blocks = _cache(LLM(weights=weights, **budget))
    full_dtype, full_blocks = _cache(LLM(weights=weights, kv_cache_dtype="float32", **budget))
    assert (half_dtype, full_dtype) == (torch.float16, torch.float32)
    # 2 layers x (K, V) x 2 KV heads x head_dim 16 x 4 tokens x 4 bytes = 2 KiB a fp32 block
    assert full_blocks == BUDGET // 2048 and half_blocks == 2 * full_blocks
    monkeypatch.setattr(kernels, "supports", lambda device, dtype: False)  # no compiler, say
    assert _cache(LLM(weights=weights, **budget))[0] == torch.float32


def test_a_bf16_cache_runs_on_pytorch_ops_and_refuses_the_kernels(
    tiny_llama: tuple[LoadedWeights, torch.nn.Module],
) -> None:
    weights, model = tiny_llama
    llm = LLM(weights=weights, block_size=4, max_num_seqs=4, kv_cache_dtype="bfloat16")
    assert _cache(llm)[0] == torch.bfloat16
    assert not (llm.engine.runner.paged_kernel or llm.engine.runner.prefill_kernel)
    # bf16 keeps 8 bits of mantissa (fp16: 11): a coarser tolerance, still far below a broken cache's
    checker = TeacherForcedReference(model, tolerance=0.1)
    prompts = _prompts(512, [3, 17, 30], seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True), progress=False)
    for prompt, out in zip(prompts, outs, strict=True):
        checker.check(prompt, out.token_ids, "bf16 cache")
    with pytest.raises(ValueError, match="decode_attention='kernel' needs .*a float32 or float16 KV cache"):
        LLM(weights=weights, block_size=4, kv_cache_dtype="bfloat16", decode_attention="kernel")
