"""Drafts for the running sequences before each step, and what their verification taught.

A sequence with k drafts asks the scheduler for 1 + k tokens: its last sampled token and the
drafts after it, scored in the step's one forward beside every other request's tokens. The target
then samples a token at each of those positions exactly as it would without drafts (the same
masks, the same per-position noise), and the drafts are kept while they equal what it sampled,
followed by the first token where they differ, or by one more token if all were right
(`accepted_prefix`). That is speculative sampling's rule for drafts that are single tokens (a draft
token d is kept with probability p(d); when it is not, the token comes from p with d taken out),
so every output is distributed as without drafts, and under greedy or a seed it is the same output.

Each sequence's draft length follows its last verification (HF's schedule): two more after a draft
accepted whole, one more than was accepted after one that was not; the step's budget (budget.py)
then keeps, of all the drafts proposed, those worth their cost in that step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.speculative.budget import DraftBudget
from tokenmill.engine.speculative.config import SpeculativeMethod, SpeculativeSettings
from tokenmill.engine.speculative.ngram import NgramIndex, prompt_lookup
from tokenmill.engine.speculative.suffix import SuffixTree, TreeEntry

if TYPE_CHECKING:
    from tokenmill.engine.sequence import Sequence

FIRST_DRAFT_LEN = 4  # a sequence's first draft length (at most num_speculative_tokens)


@dataclass
class DraftState:
    """A sequence's own proposer state (kept across preemption, like its tokens)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    tree_entry: TreeEntry | None = None  # its prompt's end and its output in the job-wide tree
    outputs_in_tree: int = 0
    tree_match: tuple[int, int] = (0, 0)  # (its tokens, the tree's longest match of their end) at the last draft
    draft_len: int = FIRST_DRAFT_LEN
    forced: int = 0  # the last draft's tokens that its grammar forced


def accepted_prefix(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified step produces: `sampled` has one token per scored position (len(drafts) + 1);
    drafts are kept while they equal it, and the first that does not is replaced by the sampled one."""
    out = []
    for i, token in enumerate(sampled):
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return out


class Drafter:
    def __init__(self, settings: SpeculativeSettings, max_model_len: int) -> None:
        self.settings = settings
        self.max_model_len = max_model_len
        self.budget = DraftBudget()
        s = settings
        self.tree = (SuffixTree(s.suffix_decoding_max_tree_depth, s.suffix_decoding_max_cached_requests)
                     if s.method is SpeculativeMethod.SUFFIX else None)
        self.seconds = 0.0  # spent proposing, all steps together

    def propose(self, decoding: list[Sequence]) -> None:
        """Set each decoding sequence's `draft_token_ids`: what it proposes, as far as the step's
        budget keeps (empty where none)."""
        started = time.perf_counter()
        states = [self._state(seq) for seq in decoding]
        drafts = [self._draft(seq, state) for seq, state in zip(decoding, states, strict=True)]
        keep = self.budget.plan(drafts, [state.forced for state in states])
        for seq, draft, kept in zip(decoding, drafts, keep, strict=True):
            seq.draft_token_ids = draft[:kept]
        self.seconds += time.perf_counter() - started

    def _state(self, seq: Sequence) -> DraftState:
        """The sequence's state, its tokens since the last step added to the job-wide tree."""
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState(draft_len=min(FIRST_DRAFT_LEN, self.settings.num_speculative_tokens))
            if self.tree is not None:
                state.tree_entry = self.tree.start(seq.prompt_token_ids[-(self.tree.max_depth // 2):])
        if self.tree is not None and state.tree_entry is not None:
            self.tree.extend(state.tree_entry, seq.token_ids[seq.num_prompt_tokens + state.outputs_in_tree:])
            state.outputs_in_tree = seq.num_output_tokens
        return state

    def _draft(self, seq: Sequence, state: DraftState) -> list[int]:
        """Tokens the sequence's grammar forces next, where it forces any (accepted unless the model
        tokenizes the same text otherwise); else the proposers', cut where the grammar refuses one."""
        s = self.settings
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        state.forced = 0
        if left <= 0:
            return []
        forced = [] if seq.matcher is None else seq.matcher.compute_ff_tokens()[: min(left, s.num_speculative_tokens)]
        if forced:
            state.forced = len(forced)
            return forced
        room = min(state.draft_len, left)
        found = prompt_lookup(seq.token_ids, state.index, s.prompt_lookup_min, s.prompt_lookup_max, room)
        draft = found.draft
        if self.tree is not None:
            context = seq.token_ids[-(self.tree.max_depth - 1):]
            tokens, matched = state.tree_match
            proposal = self.tree.propose(context, room, s.suffix_decoding_max_spec_factor,
                                         s.suffix_decoding_min_token_prob, longest=matched + seq.num_tokens - tokens)
            state.tree_match = (seq.num_tokens, proposal.match_len)
            if proposal.draft and proposal.match_len >= found.match_len:
                draft = proposal.draft
        if draft and seq.matcher is not None:  # a draft token the grammar refuses ends the draft
            draft = draft[: seq.matcher.validate_tokens(draft)]
        return draft

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Learn from how the sequence's draft fared, and set its next draft length."""
        state = seq.draft_state
        if state is None or num_drafts == 0:
            return
        forced = min(state.forced, num_drafts)
        if num_accepted >= forced:  # the proposers' part of the draft: what the budget's rates are of
            self.budget.acceptance.observe(num_drafts - forced, num_accepted - forced)
        if num_accepted == num_drafts:
            state.draft_len = min(self.settings.num_speculative_tokens, state.draft_len + 2)
        else:
            state.draft_len = max(1, num_accepted + 1)

    def finished(self, seq: Sequence) -> None:
        """The sequence left the engine: its output stays in the job-wide tree."""
        state = seq.draft_state
        if state is None or state.tree_entry is None or self.tree is None:
            return
        self._state(seq)  # its last tokens
        self.tree.finish(state.tree_entry)
        state.tree_entry = None
