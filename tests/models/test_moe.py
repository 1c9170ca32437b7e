"""The mixture-of-experts block against transformers' own (Mixtral, Qwen2-MoE with its shared
expert, Qwen3-MoE), on weights read back from the checkpoint files transformers writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenmill.models.moe import SparseMoE, is_moe_layer, stack_experts

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2)


def _config(arch: str):  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "mixtral":
        return MixtralConfig(**SMALL, num_local_experts=6)
    if arch == "qwen2_moe":  # a shared expert, and top-k weights not renormalised
        return Qwen2MoeConfig(**SMALL, num_experts=6, moe_intermediate_size=16,
                              shared_expert_intermediate_size=40, norm_topk_prob=False)
    return Qwen3MoeConfig(**SMALL, num_experts=6, moe_intermediate_size=16, norm_topk_prob=True)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_block_matches_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    state = stack_experts(load_file(str(tmp_path / "model.safetensors")))
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    intermediate = getattr(config, "moe_intermediate_size", config.intermediate_size)
    block = SparseMoE(config.hidden_size, intermediate, experts, config.num_experts_per_tok,
                      norm_topk_prob=getattr(config, "norm_topk_prob", True),
                      shared_intermediate=getattr(config, "shared_expert_intermediate_size", None))
    prefix = "model.layers.1.mlp."
    missing, unexpected = block.load_state_dict(
        {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    assert not missing and not unexpected
    x = torch.randn(37, config.hidden_size)  # enough tokens that every expert gets some, and some several
    with torch.no_grad():
        expected = model.model.layers[1].mlp(x[None])[0]
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_one_gemm_per_picked_expert_not_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    block = SparseMoE(16, 8, num_experts=4, top_k=2, norm_topk_prob=True)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    calls = []
    real = torch.nn.functional.linear

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", counting)
    block(torch.randn(50, 16))
    # The router once, then per picked expert one gate/up and one down GEMM over all its tokens.
    assert len(calls) <= 1 + 2 * 4 and sum(calls[1::2]) == 50 * 2


def test_which_layers_are_sparse() -> None:
    assert [is_moe_layer(i, 8) for i in range(3)] == [True, True, True]  # Mixtral
    assert [is_moe_layer(i, 8, decoder_sparse_step=2) for i in range(4)] == [False, True, False, True]
    assert [is_moe_layer(i, 8, mlp_only_layers=[0]) for i in range(2)] == [False, True]
    assert not is_moe_layer(0, 0)
