"""When to speculate: only where it has been measured to raise output tokens per second.

Whether drafts pay depends on how many are accepted and on what the extra tokens cost the step,
and on a CPU both move with the batch: at batch 1 a step of 16 tokens costs about what a step of
one does (the weights are read once either way), at batch 64 every token is compute. So the gate
keeps, per batch-size band, the decode output tokens per second of its steps with drafts and of its
steps without, and speculates in a band whose rate with drafts is the higher. Each arm is tried
`WARMUP_STEPS` times first, and the losing one again every `EXPLORE_EVERY`th step of its band, so
a change in the workload (acceptance falling as the rows change) is seen: that exploration is all
speculation costs where it loses. A band not yet measured follows its neighbours where they
agree (`_prior`), so a batch that grows through the bands does not pay a warm-up in each.

A step that also prefills counts too (in a long job most do: a row finishes, the next is
admitted). The choice is made before the step is scheduled, so its prefill time falls alike on
both arms: it dilutes the gap between them but does not turn it round.
"""

from __future__ import annotations

from dataclasses import dataclass

WARMUP_STEPS = 4
EXPLORE_EVERY = 48
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

    @property
    def measured(self) -> bool:
        return min(self.with_drafts.steps, self.without.steps) >= WARMUP_STEPS

    @property
    def drafts_pay(self) -> bool:
        return self.with_drafts.rate > self.without.rate


class SpeculationGate:
    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}

    @staticmethod
    def band(batch_size: int) -> int:
        """1, 2-3, 4-7, ... 32-63, 64-127: steps alike in cost per token."""
        return batch_size.bit_length()

    def speculate(self, batch_size: int) -> bool:
        """Should a decode step of this many sequences carry drafts?"""
        key = self.band(batch_size)
        band = self._bands.setdefault(key, _Band(_Arm(), _Arm()))
        band.decisions += 1
        explore = band.decisions % EXPLORE_EVERY == 0
        if band.measured:
            return band.drafts_pay != explore
        prior = self._prior(key)
        if prior is None:
            return band.with_drafts.steps < band.without.steps  # both arms in turn, without drafts first
        return prior != explore

    def _prior(self, key: int) -> bool | None:
        """What measured bands say of one that is not: a step costs more per token as the batch
        grows, so drafts that lose at a smaller batch lose here, and drafts that pay at a larger one
        pay here (None: none says). The band still explores the other arm until it knows."""
        for other, band in self._bands.items():
            if not band.measured:
                continue
            if other < key and not band.drafts_pay:
                return False
            if other > key and band.drafts_pay:
                return True
        return None

    def observe(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step of `batch_size` decoding sequences, and the tokens they produced in its `seconds`."""
        band = self._bands.setdefault(self.band(batch_size), _Band(_Arm(), _Arm()))
        (band.with_drafts if speculated else band.without).observe(tokens, seconds)

    def rates(self) -> dict[int, tuple[float, float]]:
        """Per band (its smallest batch size): measured output tok/s (with drafts, without)."""
        return {1 << (b - 1): (band.with_drafts.rate, band.without.rate) for b, band in sorted(self._bands.items())}
