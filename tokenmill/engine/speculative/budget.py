"""How many draft tokens a step carries: as many as raise its expected output tokens per second.

What a draft token is worth is the chance that it is accepted; what it costs is what one more
token adds to the step, and on a CPU that is far from constant. While a step's rows fit the
small-batch kernels, the weights are read once whatever the row count, and a few more rows cost
little; past that, or at a large batch where every row is compute, each one costs its share. So
both are measured as the job runs:

- `AcceptanceRates`: per draft position, how often a draft token there is accepted when all
  before it were (a running mean). A token's chance is the product up to its position.
- `StepCost`: a decode step's seconds by the tokens in its forward (rows and drafts), in buckets
  exact at small sizes and coarser above. Between measured buckets the cost is
  interpolated, which for a cost that is flat and then rises overstates it (a safe error).

Before a step, `DraftBudget.plan` takes the proposed draft tokens by their chance (tokens a grammar
forces first, as sure; then by position: the first proposed token of every sequence, then the
second, ...) and keeps as many as maximise
(decoding sequences + expected accepted drafts) / cost(decoding sequences + drafts). A cost is
known only up to the largest bucket measured and one bucket beyond it (extrapolated from the last
two), so the budget grows a bucket a step while that pays and stops where it does not; every
`EXPLORE_EVERY`th plan tries one bucket more than the best, or no drafts at all, in turn, so a
cost that drifts (contexts grow, acceptance changes) is seen again, the one drafts are weighed
against included. Drafts must beat none by `MARGIN`, so timing noise alone never
turns them on.
"""

from __future__ import annotations

import bisect
import itertools

EXACT_BUCKETS = 32  # steps of up to this many tokens are told apart one by one
SMOOTHING = 0.2  # the weight of the newest measurement in a running mean
FIRST_ACCEPTANCE = 0.5  # a position's rate before any of its drafts was verified
EXPLORE_EVERY = 32
MARGIN = 0.01


def bucket(tokens: int) -> int:
    """Steps alike in cost: exact up to EXACT_BUCKETS, then eight wide up to 64, sixteen up to
    128, ... (each bucket named by its largest step)."""
    if tokens <= EXACT_BUCKETS:
        return tokens
    width = 1 << (tokens.bit_length() - 3)
    return -(-tokens // width) * width


class AcceptanceRates:
    def __init__(self) -> None:
        self._rates: list[float] = []  # per draft position: accepted, given every earlier one was

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A verified draft of `num_drafts` tokens whose first `num_accepted` were kept."""
        for position in range(min(num_accepted + 1, num_drafts)):
            if position == len(self._rates):
                self._rates.append(FIRST_ACCEPTANCE)
            accepted = 1.0 if position < num_accepted else 0.0
            self._rates[position] += SMOOTHING * (accepted - self._rates[position])

    def chances(self, length: int) -> list[float]:
        """The chance that each of a draft's first `length` tokens is accepted."""
        rates = self._rates[:length] + [FIRST_ACCEPTANCE] * (length - len(self._rates))
        return list(itertools.accumulate(rates, lambda a, b: a * b))


class StepCost:
    def __init__(self) -> None:
        self._buckets: list[int] = []  # measured, ascending
        self._seconds: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        key = bucket(tokens)
        old = self._seconds.get(key)
        if old is None:
            bisect.insort(self._buckets, key)
            self._seconds[key] = seconds
        else:
            self._seconds[key] = old + SMOOTHING * (seconds - old)

    def estimate(self, tokens: int) -> float | None:
        """A step's seconds at this size; None beyond the first bucket past the largest measured."""
        key, seconds, measured = bucket(tokens), self._seconds, self._buckets
        if key in seconds:
            return seconds[key]
        at = bisect.bisect(measured, key)
        if at == 0:
            return seconds[measured[0]] if measured else None  # a smaller step costs no more
        low = measured[at - 1]
        if at < len(measured):
            high = measured[at]
            return seconds[low] + (seconds[high] - seconds[low]) * (key - low) / (high - low)
        if bucket(low + 1) != key:
            return None
        slope = 0.0
        if at >= 2:
            before = measured[at - 2]
            slope = max(0.0, (seconds[low] - seconds[before]) / (low - before))
        return seconds[low] + slope * (key - low)


class DraftBudget:
    def __init__(self) -> None:
        self.acceptance = AcceptanceRates()
        self.cost = StepCost()
        self._plans = 0

    def plan(self, drafts: list[list[int]], forced: list[int]) -> list[int]:
        """How many of each decoding sequence's proposed drafts the next step carries. `forced`: how
        many of each draft's first tokens its grammar forces (taken as sure)."""
        self._plans += 1
        batch = len(drafts)
        chances = self.acceptance.chances(max((len(d) - f for d, f in zip(drafts, forced, strict=True)), default=0))
        order = sorted(((1.0 if position < sure else chances[position - sure], position, i)
                        for i, (draft, sure) in enumerate(zip(drafts, forced, strict=True))
                        for position in range(len(draft))), key=lambda c: (-c[0], c[1]))
        options = self._options(batch, [chance for chance, _, _ in order])
        if not options:
            return [0] * batch
        best = max(range(len(options)), key=lambda k: options[k][1])
        if options[best][1] < options[0][1] * (1 + MARGIN):
            best = 0
        if self._plans % EXPLORE_EVERY == 0:  # a bucket more than the best, and none, in turn
            best = min(len(options) - 1, best + 1) if self._plans % (2 * EXPLORE_EVERY) else 0
        keep = [0] * batch
        for _, _, i in order[: options[best][0]]:
            keep[i] += 1
        return keep

    def _options(self, batch: int, chances: list[float]) -> list[tuple[int, float]]:
        """(drafts kept, expected tokens per second) for the largest number of drafts in each bucket
        whose cost is known, from none upward."""
        options: list[tuple[int, float]] = []
        accepted = list(itertools.accumulate(chances, initial=0.0))
        kept = 0
        while True:
            seconds = self.cost.estimate(batch + kept)
            if seconds is None or seconds <= 0:
                break
            options.append((kept, (batch + accepted[kept]) / seconds))
            if kept == len(chances):
                break
            kept = min(len(chances), bucket(batch + kept + 1) - batch)
        return options

    def observe(self, tokens: int, seconds: float) -> None:
        """A step's forward held `tokens` tokens and took `seconds`, end to end."""
        self.cost.observe(tokens, seconds)
