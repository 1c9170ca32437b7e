"""A plain contiguous-KV reference: greedy decoding with transformers, one prompt at a time.

Every cache path of the engine (paging, prefix hits, chunked prefill, preemption) is checked
against this. If the two ever pick different tokens, it must be an fp32 near-tie: the
reference's top-2 logits at that step within TIE_TOLERANCE, and the engine's token one of them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

TIE_TOLERANCE = 1e-3  # absolute logit gap: fp32 noise is ~1e-5 on these models


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # the reference's logits before choosing each token


@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        step_logits = out.logits[0, -1].float()
        token = int(step_logits.argmax())
        tokens.append(token)
        logits.append(step_logits)
        out = model(input_ids=torch.tensor([[token]]), **_cache_kwarg(model, out), use_cache=True)
    return Reference(tokens, logits)


def _cache_kwarg(model: torch.nn.Module, out: Any) -> dict[str, Any]:
    """The KV cache to pass on: transformers 5.2x names it `cache` (`past_key_values` is deprecated,
    to go in 5.40); earlier versions only know `past_key_values`."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def assert_matches_reference(got: list[int], ref: Reference, what: str = "") -> None:
    for step, (token, expected) in enumerate(zip(got, ref.tokens, strict=False)):
        if token == expected:
            continue
        top2 = ref.logits[step].topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert token in top2.indices.tolist() and gap <= TIE_TOLERANCE, (
            f"{what}: step {step}: engine chose {token}, reference {expected} "
            f"(reference top-2 gap {gap:.2e} > tolerance {TIE_TOLERANCE})"
        )
        return  # a legitimate near-tie flip: the continuations differ from here on
    assert len(got) == len(ref.tokens), f"{what}: {len(got)} tokens, reference {len(ref.tokens)}"


class ReferenceCache:
    """Memoises reference runs: many engine configurations are checked on the same prompts."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._runs: dict[tuple[tuple[int, ...], int], Reference] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._runs:
            self._runs[key] = reference_greedy(self.model, prompt, max_new_tokens)
        return self._runs[key]

    def check(self, prompt: list[int], got: list[int], what: str) -> None:
        assert_matches_reference(got, self(prompt, len(got)), what)


class TeacherForcedReference:
    """For quantised activations: rounding to int8 turns fp32 noise (another attention order)
    into logit steps, so greedy runs part ways at gaps far above TIE_TOLERANCE. Instead the
    reference scores the engine's own continuation, one contiguous forward, and every token the
    engine chose must be within `tolerance` of the reference's best logit at its step; a broken
    cache path picks tokens below it, and at many steps: `assert_mean_shortfall_within` bounds the
    mean over all steps, which the rare flips barely move."""

    def __init__(self, model: torch.nn.Module, tolerance: float) -> None:
        self.model, self.tolerance = model, tolerance
        self.worst = 0.0  # the largest shortfall seen: what the tolerance has to cover
        self.shortfalls: list[float] = []

    @torch.inference_mode()
    def check(self, prompt: list[int], got: list[int], what: str) -> None:
        logits = self.model(input_ids=torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1].float()
        shortfall = logits.max(-1).values - logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        self.worst = max(self.worst, float(shortfall.max()))
        self.shortfalls += shortfall.tolist()
        step = int(shortfall.argmax())
        assert shortfall[step] <= self.tolerance, (
            f"{what}: step {step}: the engine's token {got[step]} is {float(shortfall[step]):.3f} below the "
            f"reference's best logit (tolerance {self.tolerance})"
        )

    def assert_mean_shortfall_within(self, bound: float) -> None:
        mean = sum(self.shortfalls) / max(1, len(self.shortfalls))
        off = sum(x > 0 for x in self.shortfalls)
        assert mean <= bound, (f"mean shortfall {mean:.4f} > {bound} over {len(self.shortfalls)} steps "
                               f"({off} not the reference's best token)")
