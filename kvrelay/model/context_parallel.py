"""Context parallelism (CP) of a prefill: the new tokens split zig-zag over C ranks.

Each sequence's new tokens (the suffix after its cached prefix; the prefix is
never re-split) are cut into 2C contiguous chunks of whole pages (cuts on
global page boundaries) and CP rank r takes chunks r and 2C-1-r: an early,
cheap chunk and a late, expensive one, so causal attention work is even
across ranks. A rank embeds and runs only its tokens,
at their global positions (RoPE). In every layer the ranks all-gather the new
tokens' K and V (each rank then writes the K/V of every new token into its
own pool, so each holds the whole sequence and decode steps need no CP), and
each chunk attends as the last tokens of a context that ends at the chunk's
end: the backend's ordinary causal rule over a cached prefix. On the last PP
stage the final hidden states are all-gathered too, so the logits of any row
(the last token's, or all rows for the oracle tests) come out of every rank of
the last stage and the sampling rank samples as without CP.

A row's arithmetic does not depend on which rank computes it: projections and
norms are row-wise, and the attention backend is batch invariant (query
blocks cut at page boundaries, keys cut at global positions, see
`paged_attention`), which page-aligned chunks keep intact; so the pages are
the same bytes whatever C computed them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrelay.model.attention import AttentionBatch


def zigzag_chunks(num_tokens: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per CP rank, its [start, end) chunks of `num_tokens` new tokens: 2C
    chunks as even as integers allow (the first `num_tokens % 2C` one token
    longer), rank r taking chunks r and 2C-1-r. Empty chunks are dropped."""
    count = 2 * cp
    base, extra = divmod(num_tokens, count)
    bounds = [0]
    for chunk in range(count):
        bounds.append(bounds[-1] + base + (1 if chunk < extra else 0))
    chunks = []
    for rank in range(cp):
        mine = [(bounds[c], bounds[c + 1]) for c in (rank, count - 1 - rank)]
        chunks.append([(a, b) for a, b in mine if b > a])
    return chunks


@dataclass(frozen=True, slots=True)
class ContextSplit:
    """Which rows of the batch's new tokens (in batch order) each CP rank
    computes; `all_gather` turns a rank's rows back into every row."""

    comm: object  # a Comm with all_gather_cp
    rank_rows: tuple[torch.Tensor, ...]  # per CP rank, int64 rows in batch order
    total: int

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """[rows of this rank, ...] -> [all rows, ...] in batch order."""
        width = max(rows.numel() for rows in self.rank_rows)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.size(0)] = local
        parts = self.comm.all_gather_cp(padded)
        if len(parts) != len(self.rank_rows):
            raise RuntimeError(
                f"a CP={len(self.rank_rows)} prefill needs a group of that many CP ranks "
                f"(ParallelEngine(cp=...)); this engine's comm gathered {len(parts)}"
            )
        out = local.new_empty((self.total, *local.shape[1:]))
        for rows, part in zip(self.rank_rows, parts, strict=True):
            out[rows.to(out.device)] = part[: rows.numel()]
        return out


def page_zigzag_chunks(cached: int, length: int, page_size: int, cp: int):
    """`zigzag_chunks` over the pages the new tokens [cached, cached + length)
    touch, as [start, end) offsets into the new tokens: every cut lies on a
    global page boundary, so each rank's query blocks are CP=1's (the
    attention backend cuts queries at page boundaries)."""
    first = cached // page_size
    pages = -(-(cached + length) // page_size) - first

    def offset(page: int) -> int:
        return min(max((first + page) * page_size, cached), cached + length) - cached

    return [[(offset(a), offset(b)) for a, b in mine] for mine in zigzag_chunks(pages, cp)]


def split_batch(batch, comm, cp: int, cp_rank: int):
    """This CP rank's share of a prefill `ForwardBatch` (the whole batch when
    some rank would get no token: tiny prompts run replicated, like decode)."""
    att: AttentionBatch = batch.attention
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(cp)]
    mine_att: list[tuple[int, int, int, torch.Tensor]] = []  # (len, context, table)
    for start, length, context, table in att.sequences():
        cached = context - length
        for rank, chunks in enumerate(page_zigzag_chunks(cached, length, att.page_size, cp)):
            for a, b in chunks:
                per_rank[rank].append(torch.arange(start + a, start + b, dtype=torch.int64))
                if rank == cp_rank:
                    # The chunk is the tail of a context ending at its last token.
                    end = cached + b
                    pages = -(-end // att.page_size)
                    mine_att.append((b - a, end, table[:pages]))
    rank_rows = tuple(
        torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64) for rows in per_rank
    )
    if min(rows.numel() for rows in rank_rows) == 0:
        return batch
    rows = rank_rows[cp_rank]
    starts, row = [], 0
    for length, _, _ in mine_att:
        starts.append(row)
        row += length
    attention = AttentionBatch(
        tuple(starts),
        tuple(m[0] for m in mine_att),
        tuple(m[1] for m in mine_att),
        tuple(m[2] for m in mine_att),
        page_size=att.page_size,
    )
    on_device = rows.to(batch.token_ids.device)
    return replace(
        batch,
        token_ids=batch.token_ids[on_device],
        positions=batch.positions[on_device],
        attention=attention,
        # write_slots and last_rows stay those of the whole batch: K/V and the
        # final hidden states are all-gathered before they are used.
        split=ContextSplit(comm, rank_rows, int(batch.token_ids.numel())),
    )
