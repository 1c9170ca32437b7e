"""Owns the model and the KV-cache tensors; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.sampler import Sampler, SamplerOutput
from tokenmill.engine.scheduler import ScheduledSequence
from tokenmill.engine.sequence import Sequence
from tokenmill.models.attention_metadata import AttentionGroup, AttentionMetadata
from tokenmill.models.decoder import CausalLM
from tokenmill.models.huge_pages import huge_page_empty
from tokenmill.models.paged_attention import MAX_PREFILL_QUERY_GROUP


@dataclass
class _Span:
    row: int  # first row of the seq's tokens in the flat batch
    num_new: int
    context_len: int
    block_table: list[int]


# A prefill group is padded to its longest span and its longest context: spans are attended
# together only while that padding adds at most this share to the work they really need.
# (A prompt's 2-token tail beside the next prompt's 2,044-token head, padded into one group,
# took 7-8 s a step instead of ~2.4 s: Gemma 3 270M, 8 x 2,048-token prompts.)
MAX_PADDING_WASTE = 0.25


def prefill_groups(spans: list[_Span]) -> list[list[_Span]]:
    """Prefill spans split into groups attended together: similar lengths and contexts share one
    padded SDPA call (many short prompts: one call, not one each); a short span is not padded to a
    long one's size."""
    groups: list[list[_Span]] = []
    for span in sorted(spans, key=lambda s: (s.context_len, s.num_new)):
        group = groups[-1] if groups else []
        candidate = [*group, span]
        padded = len(candidate) * max(s.num_new for s in candidate) * max(s.context_len for s in candidate)
        needed = sum(s.num_new * s.context_len for s in candidate)
        if group and padded <= (1 + MAX_PADDING_WASTE) * needed:
            group.append(span)
        else:
            groups.append([span])
    return groups


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        paged_kernel: bool = False,
        prefill_kernel: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`paged_kernel`, `prefill_kernel`: attend decodes, prompt tokens with the C kernels that read the
        paged cache in place (CPU fp32 only). `kv_dtype`: the cache's elements (default: the activations')."""
        cfg = model.config
        self.paged_kernel = paged_kernel
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sliding_window = cfg.sliding_window
        self.query_group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.prefill_kernel = prefill_kernel and self.query_group <= MAX_PREFILL_QUERY_GROUP
        # Attention gathers whole blocks and masks what is not context, but a masked value
        # still must be finite (0 * NaN is NaN). So every block is zeroed the first time it
        # is used, instead of zero-filling (and committing) the whole cache up front. The
        # extra last block is the null block that pads block tables.
        self.null_block = num_blocks
        self._initialised = torch.zeros(num_blocks + 1, dtype=torch.bool)
        self.kv_dtype = dtype = kv_dtype or model.model.norm.weight.dtype  # norms have the activations' dtype
        shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = []
        for _ in range(cfg.num_hidden_layers):
            self.kv_caches.append((torch.empty(shape, dtype=dtype, device=device),
                                   torch.empty(shape, dtype=dtype, device=device)))
        self.sampler = Sampler(eos_token_ids)
        self._logits: torch.Tensor | None = None

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> SamplerOutput:
        """Run one forward over the batch; returns a token (and its logprobs, where asked) for each
        item that samples, in order, and one more after each of its draft tokens."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decodes: list[_Span] = []
        prefills: list[_Span] = []
        logits_rows: list[int] = []
        sampling: list[Sequence] = []
        offsets: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n == 1 or item.num_drafts:
                # A draft's positions attend as decodes, one query each: the numbers a plain decode
                # at each position would get, so that a verified token is the token it would sample.
                decodes.extend(_Span(len(input_ids) + i, 1, start + i + 1, seq.block_table) for i in range(n))
            else:
                prefills.append(_Span(len(input_ids), n, end, seq.block_table))
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(seq.draft_token_ids)  # the scheduler kept those that fit this step
            positions.extend(range(start, end))
            bt, bs = seq.block_table, self.block_size
            slot_mapping.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                rows = 1 + item.num_drafts
                logits_rows.extend(range(len(input_ids) - rows, len(input_ids)))
                sampling.extend([seq] * rows)
                offsets.extend(range(rows))
        groups = [self._attention_group(decodes, paged=self.paged_kernel)] if decodes else []
        if self.prefill_kernel and prefills:  # the kernel attends each span on its own: no padding
            groups.append(self._attention_group(prefills, paged=True))
        else:
            groups += [self._attention_group(spans, paged=False) for spans in prefill_groups(prefills)]
        groups[0].covers_batch = not prefills  # decodes only: one row each, in batch order
        meta = AttentionMetadata(self._tensor(slot_mapping), groups)
        logits = self.model(
            self._tensor(input_ids), self._tensor(positions), self.kv_caches, meta,
            self._tensor(logits_rows), self._logits_buffer(len(logits_rows)),
        )
        return self.sampler(logits.cpu(), sampling, offsets)

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """fp32 [rows, vocab] for a step's logits, kept from step to step: the sampler is done with
        them before the next. (A fresh one was paged in at every step: at Gemma 3's 262k-token
        vocabulary and batch 64, 67 MB, 29 of the 87 ms its output layer took.)"""
        if self._logits is None or self._logits.shape[0] < rows:
            shape = (rows, self.model.config.vocab_size)
            # On the CPU on huge pages: lm_head alone at 64 rows of Gemma 3 wrote into it 7% faster.
            cpu = self.device.type == "cpu"
            self._logits = huge_page_empty(shape, torch.float32) if cpu else torch.empty(shape, device=self.device)
        return self._logits[:rows]

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [T, vocab] at every position of one sequence, in a single prefill written to
        the first blocks of this runner's cache: for scoring (perplexity) with a runner of its own,
        never beside scheduled requests, whose blocks it would overwrite."""
        ids, positions, meta = self._whole_prompts([token_ids])
        return self.model(ids, positions, self.kv_caches, meta, torch.arange(len(ids), device=self.device))

    @torch.inference_mode()
    def prompt_hidden_states(self, sequences: list[list[int]]) -> torch.Tensor:
        """The final (normed) states [sum of lengths, hidden] of whole sequences, packed in order,
        in one forward over this runner's cache from its first block: for an embedding model's
        runner, which schedules nothing else."""
        ids, positions, meta = self._whole_prompts(sequences)
        return self.model.hidden_states(ids, positions, self.kv_caches, meta,
                                        torch.arange(len(ids), device=self.device))

    def blocks_for(self, lengths: list[int]) -> int:
        """KV blocks that whole sequences of these lengths take (each starts a block of its own)."""
        return sum(-(-n // self.block_size) for n in lengths)

    def _whole_prompts(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, attention) of whole sequences one after another, in blocks 0, 1, ...
        of the cache."""
        needed = self.blocks_for([len(seq) for seq in sequences])
        if needed > self.null_block:
            raise ValueError(f"{sum(map(len, sequences))} tokens need {needed} KV blocks; this runner has "
                             f"{self.null_block}")
        bs = self.block_size
        spans, ids, positions, first_block = [], [], [], 0
        for seq in sequences:
            blocks = -(-len(seq) // bs)
            spans.append(_Span(len(ids), len(seq), len(seq), list(range(first_block, first_block + blocks))))
            ids.extend(seq)
            positions.extend(range(len(seq)))
            first_block += blocks
        # Blocks are taken in order, so a token's slot is its sequence's first slot plus its position.
        slots = [span.block_table[0] * bs + p for span in spans for p in range(span.num_new)]
        if self.prefill_kernel:
            groups = [self._attention_group(spans, paged=True)]
        else:
            groups = [self._attention_group(group, paged=False) for group in prefill_groups(spans)]
        return self._tensor(ids), self._tensor(positions), AttentionMetadata(self._tensor(slots), groups)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device)

    def _initialise(self, tables: torch.Tensor) -> None:
        fresh = tables[~self._initialised[tables]].unique()
        if fresh.numel():
            index = fresh.to(self.device)
            for k, v in self.kv_caches:
                k.index_fill_(0, index, 0.0)
                v.index_fill_(0, index, 0.0)
            self._initialised[fresh] = True

    def _attention_group(self, spans: list[_Span], paged: bool) -> AttentionGroup:
        """`paged`: read by a C kernel (decodes or prompt spans), which needs no mask."""
        if paged and all(s.num_new == 1 for s in spans):
            return self._decode_group(spans)
        bs = self.block_size
        rows = torch.tensor([s.row for s in spans])
        num_new = torch.tensor([s.num_new for s in spans])
        ctx = torch.tensor([s.context_len for s in spans])
        lq = int(num_new.max())
        q_off = torch.arange(lq)
        query_valid = q_off[None, :] < num_new[:, None]
        query_index = torch.where(query_valid, rows[:, None] + q_off, 0)

        _, tables = self._block_tables(spans)
        max_blocks = tables.shape[1]
        # Zeroed even when the kernel (which reads only context) attends them: a block first
        # written on the kernel path may later be gathered by a prefill group.
        self._initialise(tables)
        mask = None if paged else self._mask(ctx, num_new, query_valid, max_blocks * bs)
        to = self.device
        return AttentionGroup(
            query_index.to(to), query_valid.to(to), tables.to(to), ctx.to(to),
            None if mask is None else mask.to(to), query_index[query_valid].to(to), num_new=num_new.to(to),
        )

    def _block_tables(self, spans: list[_Span]) -> tuple[list[list[int]], torch.Tensor]:
        """Each span's blocks up to its context's end, and them as one [G, widest] tensor padded
        with the null block (built at once, not one tensor a span)."""
        used = [s.block_table[: -(-s.context_len // self.block_size)] for s in spans]
        width = max(map(len, used))
        return used, torch.tensor([t + [self.null_block] * (width - len(t)) for t in used], dtype=torch.long)

    def _decode_group(self, spans: list[_Span]) -> AttentionGroup:
        """Decodes the C kernel attends (one query a span, no mask): _attention_group's result from
        five tensors built from lists. Its general form took ~0.4 ms of a 10-13 ms batch-1 step."""
        bs = self.block_size
        used, tables = self._block_tables(spans)
        # Only the block of a span's new token can be unused so far, and only from its first slot:
        # the earlier ones hold keys written (and were zeroed) at earlier steps.
        starting = [t[-1] for s, t in zip(spans, used, strict=True) if (s.context_len - 1) % bs == 0]
        if starting:
            self._initialise(torch.tensor(starting, dtype=torch.long))
        rows = torch.tensor([s.row for s in spans])  # each one's token in the flat batch
        to = self.device
        return AttentionGroup(
            rows[:, None].to(to), torch.ones(len(spans), 1, dtype=torch.bool, device=to), tables.to(to),
            torch.tensor([s.context_len for s in spans]).to(to), None, rows.to(to),
            num_new=torch.ones(len(spans), dtype=torch.long, device=to),
        )

    def _mask(self, ctx: torch.Tensor, num_new: torch.Tensor, query_valid: torch.Tensor, keys: int) -> torch.Tensor:
        """[G, 1, group*Lq, keys] bool: causal, bounded by the context (and the sliding window)."""
        k_pos = torch.arange(keys)
        q_pos = (ctx - num_new)[:, None] + torch.arange(query_valid.shape[1])  # absolute query positions
        mask = k_pos[None, None, :] <= q_pos[:, :, None]
        if self.sliding_window:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        mask &= query_valid[:, :, None]
        mask[:, :, 0] |= ~query_valid  # padded query rows look at one real key: no NaNs
        return mask.repeat(1, self.query_group, 1)[:, None]  # rows ordered (head in group, query)
