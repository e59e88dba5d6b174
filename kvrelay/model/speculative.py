"""Speculative decoding with the MTP draft layer, and the draft's paged KV.

State of a running sequence of L tokens (the last one not yet fed to the
target): target KV holds positions [0, L - 1); draft slots [0, L - 1) hold
their true KV (slot i from the target's h_i and token i + 1), and the last
draft row (slot L - 2) left its logits, the first proposal d_1, and its
normed hidden g_0. One step:

1. propose (last PP stage): d_1 = argmax of those logits; for K > 1 the layer
   chains its own g: slot L - 2 + j from (g_{j-1}, d_j) proposes d_{j+1}.
   Those chained slots hold provisional KV, overwritten in 3.
2. verify: one target forward over [t_{L-1}, d_1 .. d_k] at positions
   L - 1 .. L - 1 + k; the sampling rank accepts the longest agreeing run
   (greedy: d_j == argmax; sampling: the rejection rule below) and adds the
   target's own next token, broadcast to every rank.
3. catch up: the draft recomputes slots L - 1 .. L' - 2 from the target's
   true hidden states and the accepted tokens; its last row is the next
   step's d_1.

Rollback: target KV past the accepted tokens and provisional draft KV stay
in their slots but are never read (attention reads a sequence's context
only, and the next step rewrites those slots before anything reads them);
pages are indexed only up to the last written-and-accepted slot.

Seeded sampling: the draft proposes deterministically (its argmax: q is a
point mass), so accepting d with probability p(d) and, on a rejection,
sampling from p with d removed (renormalised) yields exactly p, the
standard speculative sampling rule for a one-hot q.

Draft pages (DESIGN.md section 3) live in a pool of their own, one layer
deep, keyed by `kvrelay.layout.draft_page_keys`; admission reuses a prefix
only as far as both target and draft pages are cached (a target hit whose
draft page is missing is recomputed, as vLLM does for EAGLE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvrelay.layout import ModelKVSpec, draft_page_keys
from kvrelay.model.decoder import ForwardBatch
from kvrelay.model.mtp import MtpLayer


@dataclass(slots=True)
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verify steps that carried at least one proposal

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "steps": self.steps}


@dataclass(slots=True)
class DraftState:
    pages: list[int]  # draft pool pages (empty on ranks without the MTP layer)
    keys: list[bytes]  # draft page keys known so far
    registered: int  # draft pages [0, registered) are indexed (or were hits)
    length: int  # draft slots [0, length) hold their true KV
    stats: SpecStats = field(default_factory=SpecStats)
    hidden: torch.Tensor | None = None  # g of slot length - 1
    logits: torch.Tensor | None = None  # its logits (the next first proposal)
    prompt_logits: torch.Tensor | None = None  # draft rows of the prefill
    proposals: list[list[int]] = field(default_factory=list)  # kept with return_logits


class SpecDecoder:
    """K-token speculation for an `Engine`; `mtp` is None on ranks that do not
    hold the MTP layer (PP stages before the last)."""

    def __init__(self, mtp: MtpLayer | None, spec: ModelKVSpec, k: int) -> None:
        if k < 1:
            raise ValueError("speculation needs K >= 1 proposals")
        self.mtp = mtp
        self.pool = mtp.pool if mtp is not None else None
        self.spec = spec
        self.k = k
        self.page_size = spec.page_size

    # -- draft pages ------------------------------------------------------
    def cached_pages(self, prompt: list[int], target_keys: list[bytes]) -> int:
        """How many of the target's hit pages also have their draft page cached."""
        if self.pool is None:
            return len(target_keys)
        hit = self.pool.match_prefix(draft_page_keys(self.spec, target_keys, prompt))
        self.pool.release(hit)
        return len(hit)

    def fits(self, pages: int) -> bool:
        return self.pool is None or self.pool.free_pages >= pages

    def admit(self, prompt: list[int], target_keys: list[bytes], cached: int, total: int):
        """Draft pages of a new sequence: the `cached` hit pages, then fresh ones."""
        if self.pool is None:
            return DraftState([], [], cached, cached * self.page_size)
        keys = draft_page_keys(self.spec, target_keys[:cached], prompt)
        hit = self.pool.match_prefix(keys)
        if len(hit) < cached:
            self.pool.release(hit)
            raise RuntimeError("draft pages vanished between lookup and admission")
        pages = hit + self.pool.allocate(total - cached)
        return DraftState(pages, keys, cached, cached * self.page_size)

    def release(self, state: DraftState | None) -> None:
        if state is not None and self.pool is not None and state.pages:
            self.pool.release(state.pages)
            state.pages = []

    def register(self, seq) -> None:
        """Index draft pages whose every slot holds its true KV."""
        state = seq.draft
        if self.pool is None or state is None:
            return
        full = min(len(seq.keys), state.length // self.page_size)
        if len(state.keys) < full:
            start = len(state.keys)
            state.keys.extend(draft_page_keys(self.spec, seq.keys[start:full], seq.tokens, start))
        for index in range(state.registered, min(full, len(state.keys))):
            self.pool.register(state.pages[index], state.keys[index])
        state.registered = max(state.registered, min(full, len(state.keys)))

    # -- prefill ----------------------------------------------------------
    def prefill(self, engine, sequences, hidden: list[list[torch.Tensor]]) -> None:
        """Draft slots [cached, prompt) of each newly prefilled sequence, from
        the target's hidden rows (`hidden[i]`: sequence i's, chunk by chunk)
        and the prompt shifted by one (its last slot takes the first sampled
        token)."""
        if self.mtp is None:
            return
        rows = []
        for seq, parts in zip(sequences, hidden, strict=True):
            begin, end = seq.draft.length, len(seq.tokens) - 1
            rows.append((seq, begin, end, torch.cat(parts)))
        want_all = any(s.request.return_logits for s in sequences)
        g, logits = self._draft_forward(rows, all_rows=want_all)
        if want_all:
            last, start = [], 0
            for seq, begin, end, _ in rows:
                if seq.request.return_logits:
                    seq.draft.prompt_logits = logits[start : start + end - begin]
                start += end - begin
                last.append(start - 1)
            g, logits = g[last], logits[last]
        for i, (seq, _, end, _) in enumerate(rows):
            seq.draft.length, seq.draft.hidden, seq.draft.logits = end, g[i], logits[i]

    # -- one speculative step ---------------------------------------------
    def decode_step(self, engine, active) -> None:
        depths = [
            min(self.k, s.request.params.max_new_tokens - len(s.generated) - 1) for s in active
        ]
        proposals = self._propose(engine, active, depths)
        spans = []
        for seq, proposed in zip(active, proposals, strict=True):
            end = len(seq.tokens)
            spans.append((seq, end - 1, end + len(proposed)))
            seq.tokens.extend(proposed)
        try:
            logits = engine._forward(spans, all_rows=True)
        finally:
            for seq, begin, _ in spans:
                del seq.tokens[begin + 1 :]
        emitted = self._accept(engine, active, proposals, logits)
        hidden = engine.shard.last_hidden if self.mtp is not None else None
        catch_up, row = [], 0
        for seq, proposed, tokens in zip(active, proposals, emitted, strict=True):
            begin = len(seq.tokens) - 1
            rows = None if logits is None else logits[row : row + len(proposed) + 1]
            count = _append(seq, tokens, rows)
            if seq.request.return_logits:
                seq.draft.proposals.append(proposed)
            if proposed:
                stats = seq.draft.stats
                stats.steps += 1
                stats.proposed += len(proposed)
                stats.accepted += min(len(tokens) - 1, count - 1)
            if hidden is not None:
                catch_up.append((seq, begin, begin + count, hidden[row : row + count]))
            row += len(proposed) + 1
        if catch_up:
            g, last_logits = self._draft_forward(catch_up, all_rows=False)
            for i, (seq, _, end, _) in enumerate(catch_up):
                seq.draft.length, seq.draft.hidden, seq.draft.logits = end, g[i], last_logits[i]
        for seq in active:
            engine._register_full_pages(seq)

    def _propose(self, engine, active, depths: list[int]) -> list[list[int]]:
        """Proposals per sequence (depths[i] of them), the same on every rank."""
        k = max(depths, default=0)
        if k <= 0:
            return [[] for _ in active]
        proposals = torch.zeros(len(active), k, dtype=torch.int64)
        if self.mtp is not None:
            proposals[:, 0] = torch.stack([torch.argmax(s.draft.logits) for s in active])
            hidden = torch.stack([s.draft.hidden for s in active])
            for depth in range(1, k):
                chained = [i for i, d in enumerate(depths) if d > depth]
                if not chained:
                    break
                rows = []
                for i in chained:
                    seq, slot = active[i], active[i].draft.length + depth - 1
                    rows.append(
                        (seq, slot, slot + 1, hidden[i : i + 1], [int(proposals[i, depth - 1])])
                    )
                g, logits = self._draft_forward(rows, all_rows=False)
                for n, i in enumerate(chained):
                    proposals[i, depth] = torch.argmax(logits[n])
                    hidden[i] = g[n]
        proposals = engine.comm.broadcast_tokens(proposals.view(-1)).view(len(active), k)
        return [proposals[i, :d].tolist() for i, d in enumerate(depths)]

    def _accept(self, engine, active, proposals, logits) -> list[list[int]]:
        """Tokens each sequence emits this step (accepted proposals, then the
        target's own), decided on the sampling rank and broadcast."""
        width = max(len(p) for p in proposals) + 2
        packed = torch.zeros(len(active), width, dtype=torch.int64)
        if engine.comm.samples:
            row = 0
            for i, (seq, proposed) in enumerate(zip(active, proposals, strict=True)):
                rows = logits[row : row + len(proposed) + 1]
                row += len(proposed) + 1
                tokens = verify(seq.sampler, rows, proposed)
                packed[i, 0] = len(tokens)
                packed[i, 1 : 1 + len(tokens)] = torch.tensor(tokens)
        packed = engine.comm.broadcast_tokens(packed.view(-1)).view(len(active), width)
        return [packed[i, 1 : 1 + int(packed[i, 0])].tolist() for i in range(len(active))]

    def _draft_forward(self, rows, all_rows: bool):
        """One MTP forward over draft slots [begin, end) of each row's sequence.
        rows: (seq, begin, end, previous hidden [end - begin, hidden][, tokens]);
        the tokens default to the sequence's tokens begin + 1 .. end."""
        spans, hiddens = [], []
        for seq, begin, end, hidden, *given in rows:
            tokens = given[0] if given else seq.tokens[begin + 1 : end + 1]
            spans.append((seq.draft.pages, tokens, begin, end))
            hiddens.append(hidden)
        batch = ForwardBatch.build(self.pool, spans, all_rows)
        return self.mtp.forward(torch.cat(hiddens), batch)


def verify(sampler, rows: torch.Tensor, proposed: list[int]) -> list[int]:
    """Tokens a sequence emits given the target's logits `rows` (one per
    proposal, plus one) and the draft's proposals: greedy keeps proposals while
    they equal the argmax; sampling accepts d with probability p(d) and, on a
    rejection, draws from p without d."""
    emitted = []
    for j, token in enumerate(proposed):
        if sampler.params.greedy:
            best = int(torch.argmax(rows[j]))
            emitted.append(best)
            if best != token:
                return emitted
            continue
        probs = sampler.probs(rows[j])
        if float(torch.rand((), generator=sampler.generator, dtype=torch.float64)) < probs[token]:
            emitted.append(token)
            continue
        probs[token] = 0.0
        emitted.append(int(torch.multinomial(probs / probs.sum(), 1, generator=sampler.generator)))
        return emitted
    emitted.append(sampler(rows[len(proposed)]))
    return emitted


def _append(seq, tokens: list[int], rows) -> int:
    """Appends emitted tokens until a stop token or max_new_tokens; returns how many."""
    params = seq.request.params
    for count, token in enumerate(tokens, 1):
        if rows is not None and seq.request.return_logits:
            seq.step_logits.append(rows[count - 1].clone())
        seq.generated.append(token)
        seq.tokens.append(token)
        if token in params.stop_token_ids:
            seq.finish_reason = "stop"
            return count
        if len(seq.generated) >= params.max_new_tokens:
            seq.finish_reason = "length"
            return count
    return len(tokens)
