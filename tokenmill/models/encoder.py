"""The encoder forward for embeddings: the BERT family (all-MiniLM, BGE, E5, GTE and the other
BertModel checkpoints sentence-transformers loads): absolute positions, token types, post-norm
layers, GELU, bidirectional attention, no KV cache.

Read top to bottom: a batch's sequences arrive packed (`PackedBatch`: their tokens concatenated,
so the linear layers see no padding); attention alone lays them out padded to the batch's longest,
which the embedder keeps close to the others by sorting inputs by length (embed/batching.py).
Hugging Face's parameter names are mapped onto these modules by `encoder_state_dict`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models import kernels
from tokenmill.models.encoder_attention import packed_attention
from tokenmill.models.encoder_config import EncoderConfig
from tokenmill.models.quant import install_quantized, quantize

# config.json's hidden_act → the activation (encoder_config.ENCODER_ACTIVATIONS). "gelu" is the
# exact (erf) one, as transformers' ACT2FN.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# The kernel attends batches up to this length: past it, the cost of the padded layout is small
# beside the attention itself, which SDPA's blocked kernel computes faster (docs/embeddings.md).
KERNEL_LONGEST = 128


@dataclass
class PackedBatch:
    """Sequences packed end to end: `token_ids` [T], and each one's length. Attention's padded
    layout (and the way back from it) is derived once per batch and shared by every layer."""

    token_ids: torch.Tensor  # [T], int64
    lengths: list[int]

    @cached_property
    def positions(self) -> torch.Tensor:
        """Each token's position within its own sequence."""
        return torch.cat([torch.arange(n) for n in self.lengths])

    @cached_property
    def sequence_of_token(self) -> torch.Tensor:
        """[T]: the index of the sequence each token belongs to."""
        return torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @property
    def uniform(self) -> bool:
        """All sequences the same length: the padded layout is the packed one, reshaped."""
        return min(self.lengths) == self.longest

    @cached_property
    def padded_rows(self) -> torch.Tensor:
        """[T]: each token's row in the padded [B × longest] layout."""
        return self.sequence_of_token * self.longest + self.positions

    @cached_property
    def starts(self) -> torch.Tensor:
        """[B + 1] int64: sequence i is tokens starts[i] .. starts[i + 1]."""
        return torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int64)

    @cached_property
    def key_mask(self) -> torch.Tensor:
        """[B, 1, 1, longest]: True where a key is a real token (padding keys get no weight)."""
        mask = torch.arange(self.longest)[None, :] < torch.tensor(self.lengths)[:, None]
        return mask[:, None, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # query, key, value in one GEMM
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.kernel = False  # attend in place with csrc/encoder_attention.c (set by build_encoder)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        qkv = self.qkv(x)
        if self.kernel and batch.longest <= KERNEL_LONGEST:
            return self.out(packed_attention(qkv, batch.starts, self.num_heads, self.head_dim))
        return self.out(self.padded_sdpa(qkv, batch))

    def padded_sdpa(self, qkv: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """The same attention by PyTorch's SDPA, over the batch padded to its longest sequence."""
        width = qkv.shape[1] // 3
        if not batch.uniform:  # padded once for q, k and v together
            qkv = qkv.new_zeros(len(batch.lengths) * batch.longest, 3 * width).index_copy_(0, batch.padded_rows, qkv)
        q, k, v = qkv.view(len(batch.lengths), batch.longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = None if batch.uniform else batch.key_mask
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, longest, head_dim]
        heads = heads.transpose(1, 2).reshape(-1, width)
        return heads if batch.uniform else heads.index_select(0, batch.padded_rows)


class EncoderLayer(nn.Module):
    """Post-norm: each sub-layer's output is added to its input, then normalised."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, batch))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class Encoder(nn.Module):
    """Token ids → one hidden state per token (the last layer's), for pooling."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embedding_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        # One text per sequence: every token is of type 0, as the tokenizer marks a single segment.
        x = (self.word_embeddings(batch.token_ids) + self.token_type_embeddings.weight[0]
             + self.position_embeddings(batch.positions))
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        return x  # [T, hidden]


# ---- Hugging Face names ----------------------------------------------------------------------------
# BertModel's parameter names (a task head's checkpoint adds "bert." before them) → Encoder's. The
# pooler is BERT's next-sentence head, which sentence embeddings do not use.
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings.": "word_embeddings.",
    "embeddings.position_embeddings.": "position_embeddings.",
    "embeddings.token_type_embeddings.": "token_type_embeddings.",
    "embeddings.LayerNorm.": "embedding_norm.",
}
_LAYER_NAMES = {
    "attention.output.dense.": "attention.out.",
    "attention.output.LayerNorm.": "attention_norm.",
    "intermediate.dense.": "up.",
    "output.dense.": "down.",
    "output.LayerNorm.": "mlp_norm.",
}
_QKV = ("query", "key", "value")
_UNUSED = ("pooler.", "embeddings.position_ids", "cls.")


def encoder_state_dict(hf: dict[str, torch.Tensor], cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """A BertModel checkpoint's tensors under Encoder's names, query/key/value joined into one
    projection. ValueError names a tensor that is missing or that nothing reads."""
    hf = {name.removeprefix("bert."): t for name, t in hf.items() if not name.removeprefix("bert.").startswith(_UNUSED)}
    qkv = {f"encoder.layer.{i}.attention.self.{p}.{kind}" for i in range(cfg.num_hidden_layers)
           for p in _QKV for kind in ("weight", "bias")}
    state = {_encoder_name(name, cfg): t for name, t in hf.items() if name not in qkv}
    for i in range(cfg.num_hidden_layers):
        for kind in ("weight", "bias"):
            parts = [f"encoder.layer.{i}.attention.self.{p}.{kind}" for p in _QKV]
            missing = [p for p in parts if p not in hf]
            if missing:
                raise ValueError(f"the checkpoint has no {missing[0]!r}")
            state[f"layers.{i}.attention.qkv.{kind}"] = torch.cat([hf[p] for p in parts])
    return state


def _encoder_name(name: str, cfg: EncoderConfig) -> str:
    prefix = next((p for p in _EMBEDDING_NAMES if name.startswith(p)), None)
    if prefix is not None:
        return _EMBEDDING_NAMES[prefix] + name[len(prefix):]
    layer, _, rest = name.removeprefix("encoder.layer.").partition(".")
    prefix = next((p for p in _LAYER_NAMES if rest.startswith(p)), None)
    if not name.startswith("encoder.layer.") or prefix is None:
        raise ValueError(f"tensor {name!r} is not part of a {cfg.num_hidden_layers}-layer BertModel")
    return f"layers.{layer}.{_LAYER_NAMES[prefix]}{rest[len(prefix):]}"


def build_encoder(cfg: EncoderConfig, hf_state: dict[str, torch.Tensor], weight_bits: int | None = None,
                  attention_kernel: bool = True) -> Encoder:
    """`weight_bits` 8: every linear layer in 8-bit blocks through the quantised GEMM (models/quant.py,
    activations quantised per block as they arrive); None: fp32, exact. `attention_kernel`: attend
    with the C kernel where it builds (else, or False, with SDPA)."""
    with torch.device("meta"):
        model = Encoder(cfg)
    state = {name: t.float() for name, t in encoder_state_dict(hf_state, cfg).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"the weights do not match a {cfg.num_hidden_layers}-layer BertModel "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if weight_bits is not None:
        install_quantized(model, {f"{name}.weight": quantize(module.weight, weight_bits)
                                  for name, module in model.named_modules() if isinstance(module, nn.Linear)})
    use_kernel = (attention_kernel and kernels.supports(torch.device("cpu"), torch.float32)
                  and (cfg.hidden_size // cfg.num_attention_heads) % 8 == 0)  # the kernel's vectors of 8
    for layer in model.layers:
        layer.attention.kernel = use_kernel
    return model.eval()
