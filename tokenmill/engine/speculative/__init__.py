"""Speculative decoding without a draft model: proposers (prompt lookup, a job-wide suffix tree),
the rule that keeps a draft's verified prefix, and the budget that keeps as many drafts in a step as
pay for themselves there.
Nothing here imports torch: drafts are token ids, proposed on the CPU between steps."""

from tokenmill.engine.speculative.config import (
    METHODS,
    SpeculativeMethod,
    SpeculativeSettings,
    speculative_config,
    speculative_settings,
)
from tokenmill.engine.speculative.drafter import Drafter, accepted_prefix

__all__ = ["METHODS", "Drafter", "SpeculativeMethod", "SpeculativeSettings", "accepted_prefix",
           "speculative_config", "speculative_settings"]
