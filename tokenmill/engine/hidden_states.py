"""A decoder (models/decoder.py: Llama, Qwen2/3, Gemma 3, ...) as an embedding model's network, as
in Qwen3-Embedding: whole inputs through the causal forward, one batch a step, in a KV cache of its
own; the embedder (embed/embedder.py) pools the final states as the model's folder says. Its
checkpoint may be the bare backbone (`Qwen3Model`: no `model.` prefix, no output layer)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.models import kernels
from tokenmill.models.build import build_model
from tokenmill.models.config import ModelConfig
from tokenmill.models.encoder import PackedBatch
from tokenmill.models.loader import LoadedWeights, check_folder, read_tensors

BLOCK_SIZE = 16  # each input starts a block: small blocks waste little cache on short inputs
_BACKBONE_PREFIX = "model."


class DecoderEmbeddingModel:
    """`model(batch)`: the final states [T, hidden] of a PackedBatch, what `pool` reads."""

    def __init__(self, folder: Path, weight_format: str, max_num_batched_tokens: int) -> None:
        cfg, files = check_folder(folder, generating=False)
        self.config = ModelConfig.from_hf(cfg)
        state = _with_backbone_prefix(read_tensors(files, torch.float32))
        weights = LoadedWeights(str(folder), self.config, dict(state), tokenizer=None)
        device = torch.device("cpu")
        self._kernels = kernels.supports(device, torch.float32)
        self.model = build_model(weights, self.config.max_position_embeddings, device, torch.float32,
                                 batch_hint=max_num_batched_tokens, weight_format=weight_format, head=False)
        # A batch of n inputs within the budget needs at most budget / BLOCK_SIZE + n blocks: this
        # covers every input starting a block of its own; a batch past it grows the cache.
        self._runner = self._new_runner(2 * -(-max_num_batched_tokens // BLOCK_SIZE))

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        needed = self._runner.blocks_for(batch.lengths)
        if needed > self._runner.null_block:
            self._runner = self._new_runner(needed)
        sequences = [part.tolist() for part in batch.token_ids.split(batch.lengths)]
        return self._runner.prompt_hidden_states(sequences)

    def _new_runner(self, num_blocks: int) -> ModelRunner:
        return ModelRunner(self.model, num_blocks, BLOCK_SIZE, eos_token_ids=[], device=torch.device("cpu"),
                           prefill_kernel=self._kernels)


def _with_backbone_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bare backbone's names (`layers.0...`, `embed_tokens.weight`) under the causal LM's (`model.`)."""
    if any(name.startswith((_BACKBONE_PREFIX, "language_model.")) for name in state):
        return state
    return {_BACKBONE_PREFIX + name: tensor for name, tensor in state.items()}
