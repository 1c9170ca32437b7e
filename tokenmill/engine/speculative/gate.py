"""When to speculate: only where it has been measured to raise output tokens per second.

Whether drafts pay depends on how many are accepted and on what the extra tokens cost the step,
and on a CPU both move with the batch: at batch 1 a step of 16 tokens costs about what a step of
one does (the weights are read once either way), at batch 64 every token is compute. So the gate
keeps, per batch-size band, the output tokens per second measured in decode steps with drafts and
in decode steps without, and speculates in the band whose measured rate with drafts is higher.
Each arm is tried `WARMUP_STEPS` times first, and the losing one again every `EXPLORE_EVERY`th step
of its band, so a change in the workload (acceptance falling as the rows change) is seen: that
exploration is all speculation can cost where it loses.
"""

from __future__ import annotations

from dataclasses import dataclass

WARMUP_STEPS = 4
EXPLORE_EVERY = 32
SMOOTHING = 0.1  # the weight of the newest step in each arm's running means


@dataclass
class _Arm:
    steps: int = 0
    tokens: float = 0.0  # running means over its steps
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        weight = 1.0 if self.steps == 0 else SMOOTHING
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.steps += 1


@dataclass
class _Band:
    with_drafts: _Arm
    without: _Arm
    decisions: int = 0


class SpeculationGate:
    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}

    @staticmethod
    def band(batch_size: int) -> int:
        """1, 2-3, 4-7, ... 32-63, 64-127: steps alike in cost per token."""
        return batch_size.bit_length()

    def speculate(self, batch_size: int) -> bool:
        """Should a decode step of this many sequences carry drafts?"""
        band = self._bands.setdefault(self.band(batch_size), _Band(_Arm(), _Arm()))
        band.decisions += 1
        on, off = band.with_drafts, band.without
        if min(on.steps, off.steps) < WARMUP_STEPS:
            return on.steps <= off.steps
        better = on.rate > off.rate
        return better != (band.decisions % EXPLORE_EVERY == 0)

    def observe(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step (no prefill in it) and the output tokens it produced in `seconds`."""
        band = self._bands.setdefault(self.band(batch_size), _Band(_Arm(), _Arm()))
        (band.with_drafts if speculated else band.without).observe(tokens, seconds)

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per band (its smallest batch size): measured output tok/s (with drafts, without)."""
        return {1 << (b - 1): (band.with_drafts.rate, band.without.rate) for b, band in sorted(self._bands.items())}
