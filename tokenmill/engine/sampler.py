"""Next-token choice: greedy, temperature, top-k, top-p, with per-request generators, among the
tokens a structured-output request's grammar allows."""

from __future__ import annotations

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.engine.structured_outputs import allowed_tokens_bitmask, apply_bitmask


class Sampler:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [S, V] fp32, one row per sequence, in order."""
        self._suppress_stops_before_min_tokens(logits, seqs)
        self._apply_grammars(logits, seqs)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = self._filtered_probs(logits[rows], [seqs[i] for i in sampled_rows])
            for row, p in zip(sampled_rows, probs, strict=True):
                tokens[row] = _draw(p, seqs[row].generator)
        return tokens.tolist()

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        matchers = [(seq.matcher, row) for row, seq in enumerate(seqs) if seq.matcher is not None]
        if matchers:
            apply_bitmask(logits, allowed_tokens_bitmask(matchers, len(seqs), logits.shape[1]))

    def _suppress_stops_before_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            # A grammar alone decides where its output may end.
            if seq.num_output_tokens < seq.params.min_tokens and seq.matcher is None:
                banned = list(seq.params.stop_token_ids)
                if not seq.params.ignore_eos:
                    banned += self.eos_token_ids
                if banned:
                    logits[row, banned] = float("-inf")

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([s.params.top_k or vocab for s in seqs]).clamp(max=vocab)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        remove = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p (keeps the first).
        remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        filtered = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Exponential race (Gumbel-max in disguise): one draw per request from its own generator,
    # so a seeded request samples the same tokens whatever else shares its batch.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
