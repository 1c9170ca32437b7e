"""The encoder forward against transformers' own BertModel on tiny random checkpoints: every
token's last hidden state, packed batches of mixed and equal lengths, and each pooling."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from tokenmill.models import kernels
from tokenmill.models.encoder import PackedBatch, build_encoder
from tokenmill.models.encoder_config import EncoderConfig
from tokenmill.models.pooling import PoolingConfig, PoolingMode, pool


def tiny_bert(hidden_act: str = "gelu", prefix: str = "", hidden_size: int = 64
              ) -> tuple[BertModel, EncoderConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=120, hidden_size=hidden_size, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=64, hidden_act=hidden_act)
    model = BertModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():  # LayerNorms start at 1/0: random ones test that they are read
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    state = {prefix + name: t for name, t in model.state_dict().items()}
    return model, EncoderConfig.from_hf(cfg.to_dict()), state


def reference(model: BertModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' states of each sequence alone: no padding anywhere."""
    with torch.no_grad():
        return [model(torch.tensor([seq])).last_hidden_state[0] for seq in sequences]


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
@pytest.mark.parametrize("lengths", [[5, 17, 1, 40, 9], [12, 12, 12], [63], [1] * 20 + [33]])
@pytest.mark.parametrize("attention_kernel", [True, False])
def test_packed_states_match_transformers(hidden_act: str, lengths: list[int], attention_kernel: bool) -> None:
    model, cfg, state = tiny_bert(hidden_act)
    encoder = build_encoder(cfg, state, attention_kernel=attention_kernel)
    assert encoder.layers[0].attention.kernel == (attention_kernel and kernels.supports(torch.device("cpu"),
                                                                                           torch.float32))
    g = torch.Generator().manual_seed(len(lengths))
    sequences = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    batch = PackedBatch(torch.tensor([t for s in sequences for t in s]), lengths)
    with torch.no_grad():
        states = encoder(batch).split(lengths)
    for mine, theirs in zip(states, reference(model, sequences), strict=True):
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", list(PoolingMode))
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_matches_its_definition(mode: PoolingMode, normalize: bool) -> None:
    model, cfg, state = tiny_bert()
    encoder = build_encoder(cfg, state)
    sequences = [[1, 5, 9, 2], [1, 7, 2], [1, 3, 3, 3, 3, 3, 8, 2]]
    batch = PackedBatch(torch.tensor([t for s in sequences for t in s]), [len(s) for s in sequences])
    with torch.no_grad():
        vectors = pool(encoder(batch), batch, PoolingConfig(mode, normalize))
    for vector, states in zip(vectors, reference(model, sequences), strict=True):
        expected = {PoolingMode.MEAN: states.mean(0), PoolingMode.CLS: states[0], PoolingMode.LAST: states[-1]}[mode]
        if normalize:
            expected = expected / expected.norm()
        torch.testing.assert_close(vector, expected, atol=2e-5, rtol=1e-4)


def test_a_head_width_the_kernel_cannot_take_attends_with_sdpa() -> None:
    model, cfg, state = tiny_bert(hidden_size=48)  # heads of 12
    encoder = build_encoder(cfg, state)
    assert not encoder.layers[0].attention.kernel
    batch = PackedBatch(torch.tensor([1, 2, 3, 4, 5]), [2, 3])
    with torch.no_grad():
        states = encoder(batch).split([2, 3])
    for mine, theirs in zip(states, reference(model, [[1, 2], [3, 4, 5]]), strict=True):
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-4)


def test_eight_bit_linears_stay_close_to_fp32() -> None:
    _, cfg, state = tiny_bert()
    exact, eight_bit = build_encoder(cfg, state), build_encoder(cfg, state, weight_bits=8)
    batch = PackedBatch(torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(3)), [20, 30])
    mean = PoolingConfig(PoolingMode.MEAN, normalize=True)
    with torch.no_grad():
        a, b = (pool(encoder(batch), batch, mean) for encoder in (exact, eight_bit))
    assert torch.isclose((a * b).sum(1), torch.ones(2), atol=2e-3).all() and not torch.equal(a, b)


def test_a_task_head_checkpoint_loads_by_its_bert_prefix() -> None:
    model, cfg, state = tiny_bert(prefix="bert.")
    encoder = build_encoder(cfg, {**state, "cls.predictions.bias": torch.zeros(cfg.vocab_size)})
    batch = PackedBatch(torch.tensor([1, 2, 3]), [3])
    with torch.no_grad():
        torch.testing.assert_close(encoder(batch), reference(model, [[1, 2, 3]])[0], atol=2e-5, rtol=1e-4)


def test_weights_of_another_shape_are_refused_by_name() -> None:
    _, cfg, state = tiny_bert()
    del state["encoder.layer.2.attention.self.key.weight"]
    with pytest.raises(ValueError, match="encoder.layer.2.attention.self.key.weight"):
        build_encoder(cfg, state)
    _, cfg, state = tiny_bert()
    with pytest.raises(ValueError, match="not part of a 3-layer BertModel"):
        build_encoder(cfg, {**state, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(1)})


@pytest.mark.parametrize(("change", "message"), [
    ({"position_embedding_type": "relative_key"}, "absolute positions only"),
    ({"hidden_act": "swish"}, "hidden_act 'swish' is not supported"),
    ({"model_type": "roberta"}, "not an encoder tokenmill runs"),
])
def test_configs_it_cannot_compute_are_refused(change: dict[str, str], message: str) -> None:
    cfg = {**BertConfig(vocab_size=10, hidden_size=8, num_attention_heads=2).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        EncoderConfig.from_hf(cfg)
