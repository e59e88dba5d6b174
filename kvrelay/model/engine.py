"""The engine: admission against the paged pool, batched prefill over a cached
prefix, batched decode steps, sampling and stop conditions.

Every rank of a TP x PP group runs this same loop on the same requests; the
`Comm` seam makes the ranks agree (usable prefix, admission) and carries the
sampled tokens from the sampling rank to all others.
"""

from __future__ import annotations

import time

import torch

from kvrelay.layout import ModelKVSpec, ParallelConfig
from kvrelay.model.context_parallel import split_batch
from kvrelay.model.decoder import DecoderShard, ForwardBatch
from kvrelay.model.errors import PoolExhausted, RequestError
from kvrelay.model.pool import partial_page_key
from kvrelay.model.requests import Request, Result, Sequence, StepOutput
from kvrelay.model.sampling import Sampler
from kvrelay.model.speculative import SpecDecoder

DEFAULT_MAX_PREFILL_TOKENS = 4096


class Engine:
    def __init__(
        self,
        shard: DecoderShard,
        spec: ModelKVSpec,
        parallel: ParallelConfig | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        draft: SpecDecoder | None = None,
    ) -> None:
        if spec.page_size != shard.pool.page_size:
            raise ValueError("the pool's page size must be the unified page size")
        if max_prefill_tokens <= 0:
            raise ValueError("max_prefill_tokens must be positive")
        # Chunked prefill: one forward computes at most this many new tokens,
        # which bounds activations and attention state per layer.
        self.max_prefill_tokens = max_prefill_tokens
        self.shard = shard
        self.pool = shard.pool
        self.spec = spec
        self.comm = shard.comm
        self.namespace = spec.namespace()
        self.parallel = parallel or ParallelConfig()
        # Speculative decoding with an MTP layer (None: one token per step).
        self.draft = draft
        shard.keep_hidden = draft is not None and draft.mtp is not None
        # Continuous batching state: admitted but not yet prefilled, and decoding.
        self._pending: list[Sequence] = []
        self._active: list[Sequence] = []
        self._next_id = 1

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def generate(self, requests: list[Request]) -> list[Result]:
        """Runs a batch to completion. All-or-nothing admission: PoolExhausted
        when the batch does not fit, with every page returned to the pool."""
        if not requests:
            return []
        if self._pending or self._active:
            raise RuntimeError("generate() needs an idle engine (sequences are running)")
        start = time.perf_counter()
        try:
            for request in requests:
                self.admit(request)
            sequences = list(self._pending)
            self.step()
            prefilled = time.perf_counter()
            while self._active:
                self.step()
            done = time.perf_counter()
        finally:
            # Whatever is still running (an exception) gives its pages back.
            for seq in self._pending + self._active:
                self.cancel(seq.seq_id)
        return [
            Result(
                tokens=s.generated,
                finish_reason=s.finish_reason or "length",
                cached_tokens=s.cached,
                prompt_logits=s.prompt_logits,
                step_logits=s.step_logits,
                prefill_seconds=prefilled - start,
                decode_seconds=done - prefilled,
                spec=s.draft.stats.as_dict() if s.draft else None,
                draft_prompt_logits=s.draft.prompt_logits if s.draft else None,
                proposals=s.draft.proposals if s.draft else [],
            )
            for s in sequences
        ]

    # -- continuous batching ---------------------------------------------
    def admit(self, request: Request) -> int:
        """Adds a sequence to the running batch; its prompt is computed at the
        next `step`. Returns its id. PoolExhausted (nothing taken) when its
        pages do not fit now."""
        seq = self._admit(request)
        seq.seq_id = self._next_id
        self._next_id += 1
        self._pending.append(seq)
        return seq.seq_id

    def step(self) -> list[StepOutput]:
        """One step of the running batch: the prompts of newly admitted
        sequences are computed (each gets its first token), then every other
        running sequence gets one token. Finished sequences leave the batch
        and return their pages."""
        pending, decoding = self._pending, self._active
        self._pending = []
        before = [len(seq.generated) for seq in decoding]
        if pending:
            self._active = decoding + pending
            self._prefill(pending)
        if decoding and self.draft is not None:
            self.draft.decode_step(self, decoding)
        elif decoding:
            self._decode_step(decoding)
        outputs = []
        for seq, old in zip(pending + decoding, [0] * len(pending) + before, strict=True):
            outputs.append(
                StepOutput(seq.seq_id, seq.generated[old:], seq.finish_reason, seq.cached)
            )
            if seq.finish_reason is not None:
                outputs[-1].all_tokens = list(seq.tokens)
                outputs[-1].spec = seq.draft.stats.as_dict() if seq.draft else None
                self._finish(seq)
        return outputs

    def cancel(self, seq_id: int) -> bool:
        """Drops a running sequence and returns its pages; False if unknown."""
        for group in (self._pending, self._active):
            for seq in group:
                if seq.seq_id == seq_id:
                    group.remove(seq)
                    self.pool.release(seq.pages)
                    if self.draft is not None:
                        self.draft.release(seq.draft)
                    return True
        return False

    @property
    def running(self) -> int:
        return len(self._pending) + len(self._active)

    def _finish(self, seq: Sequence) -> None:
        self._active.remove(seq)
        try:
            self._index_partial_pages([seq])
        finally:
            self.pool.release(seq.pages)
            seq.pages = []
            if self.draft is not None:
                self.draft.release(seq.draft)

    # -- admission --------------------------------------------------------
    def _admit(self, request: Request) -> Sequence:
        prompt = [int(t) for t in request.prompt]
        vocab = self.shard.config.vocab_size
        if not prompt:
            raise RequestError("empty prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        ps = self.page_size
        chain = self.spec.key_chain(prompt)
        keys = chain.keys
        # At least the last prompt token is computed: its logits pick the first token.
        usable = min(len(keys), (len(prompt) - 1) // ps)
        hit = self.pool.match_prefix(keys[:usable])
        if self.draft is not None:
            # Reuse only as far as the draft's pages are cached too; target
            # pages past that are recomputed (the draft needs their hidden states).
            drafted = self.draft.cached_pages(prompt, keys[: len(hit)])
            self.pool.release(hit[drafted:])
            hit = hit[:drafted]
        agreed = self.comm.min_all(len(hit))
        self.pool.release(hit[agreed:])
        hit = hit[:agreed]
        # KV slots for the prompt and every generated token but the last.
        total_pages = -(-(len(prompt) + request.params.max_new_tokens - 1) // ps)
        fits = self.pool.free_pages >= total_pages - agreed
        fits = fits and (self.draft is None or self.draft.fits(total_pages - agreed))
        if not self.comm.min_all(int(fits)):
            available = self.pool.free_pages
            self.pool.release(hit)
            raise PoolExhausted(total_pages - agreed, available)
        pages = hit + self.pool.allocate(total_pages - agreed)
        draft = None
        if self.draft is not None:
            # A partial page's draft state is not kept: the tail is recomputed.
            draft = self.draft.admit(prompt, keys, agreed, total_pages)
            cached = agreed * ps
        else:
            cached = agreed * ps + self._reuse_partial_page(prompt, keys, agreed, pages)
        return Sequence(
            request=request,
            tokens=prompt,
            pages=pages,
            cached=cached,
            chain=chain,
            registered=agreed,
            sampler=Sampler(request.params, skip=request.skip_draws, vocab=vocab),
            draft=draft,
        )

    def _reuse_partial_page(self, prompt, keys, full: int, pages: list[int]) -> int:
        """After `full` cached pages, the longest indexed partial page that the
        prompt continues (short of its last token) is copied into the
        sequence's own page `full`. Returns the tokens reused (ranks agree)."""
        ps = self.page_size
        parent = keys[full - 1] if full else self.namespace
        start = full * ps
        found, count = None, 0
        for length in range(min(ps - 1, len(prompt) - 1 - start), 0, -1):
            hit = self.pool.match_prefix([partial_page_key(parent, prompt[start : start + length])])
            if hit:
                found, count = hit[0], length
                break
        agreed = self.comm.min_all(count)
        if found is not None:
            if agreed:
                self.pool.copy_tokens(found, pages[full], agreed)
            self.pool.release([found])
        return agreed

    def _index_partial_pages(self, sequences: list[Sequence]) -> None:
        """Keep each finished sequence's last partial page findable: its tokens'
        KV is written, and a continuation (or an export) can reuse it."""
        ps = self.page_size
        for seq in sequences:
            with_kv = len(seq.tokens) - 1
            index, count = divmod(with_kv, ps)
            if count and index >= seq.registered:
                parent = seq.keys[index - 1] if index else self.namespace
                tail = seq.tokens[index * ps : index * ps + count]
                self.pool.register(seq.pages[index], partial_page_key(parent, tail))

    # -- execution --------------------------------------------------------
    def _prefill(self, sequences: list[Sequence]) -> None:
        """The prompts' uncached tokens, in forwards of at most
        `max_prefill_tokens` tokens (a later chunk attends to the earlier
        ones' KV in the pool, as to a cached prefix)."""
        all_rows = any(s.request.return_logits for s in sequences)
        last: dict[int, torch.Tensor] = {}
        parts: dict[int, list[torch.Tensor]] = {id(s): [] for s in sequences}
        hidden: dict[int, list[torch.Tensor]] = {id(s): [] for s in sequences}
        for spans in self._prefill_chunks(sequences):
            logits = self._forward(spans, all_rows=all_rows, split=self.parallel.cp > 1)
            if logits is None:
                continue  # not the last stage
            if self.shard.keep_hidden:  # the draft needs every row's hidden state
                at = 0
                for seq, begin, end in spans:
                    hidden[id(seq)].append(self.shard.last_hidden[at : at + end - begin])
                    at += end - begin
            row = 0
            for seq, begin, end in spans:
                rows = end - begin if all_rows else 1
                if all_rows and seq.request.return_logits:
                    parts[id(seq)].append(logits[row : row + rows])
                if end == len(seq.tokens):
                    last[id(seq)] = logits[row + rows - 1]
                row += rows
        logits = None
        if last:
            logits = torch.stack([last[id(s)] for s in sequences])
            for seq in sequences:
                if seq.request.return_logits:
                    # Results leave the rank (pickled to the parent): host copies.
                    seq.prompt_logits = torch.cat(parts[id(seq)]).cpu()
        self._sample(sequences, logits)
        if self.draft is not None:
            self.draft.prefill(self, sequences, [hidden[id(s)] for s in sequences])
        for seq in sequences:
            self._register_full_pages(seq)

    def _prefill_chunks(self, sequences: list[Sequence]):
        """Spans (seq, begin, end) grouped into forwards of at most
        `max_prefill_tokens` tokens, in order."""
        chunk, room = [], self.max_prefill_tokens
        for seq in sequences:
            begin = seq.cached
            while begin < len(seq.tokens):
                end = min(len(seq.tokens), begin + room)
                chunk.append((seq, begin, end))
                room -= end - begin
                begin = end
                if room == 0:
                    yield chunk
                    chunk, room = [], self.max_prefill_tokens
        if chunk:
            yield chunk

    def _decode_step(self, active: list[Sequence]) -> None:
        spans = [(s, len(s.tokens) - 1, len(s.tokens)) for s in active]
        logits = self._forward(spans, all_rows=False)
        self._sample(active, logits)
        for seq in active:
            self._register_full_pages(seq)

    def _forward(self, spans, all_rows: bool, split: bool = False) -> torch.Tensor | None:
        """One forward over tokens [begin, end) of each sequence (end - 1 is the
        last token whose KV gets written). `split`: the new tokens are shared
        out over the CP ranks (prefill); decode steps run whole on every rank."""
        batch = ForwardBatch.build(
            self.pool, ((s.pages, s.tokens[b:e], b, e) for s, b, e in spans), all_rows
        )
        if split:
            batch = split_batch(batch, self.comm, self.parallel.cp, self.parallel.cp_rank)
        return self.shard.forward(batch)

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor | None) -> None:
        """logits: [len(sequences), vocab] on the last stage, else None."""
        chosen = torch.zeros(len(sequences), dtype=torch.int64)
        if self.comm.samples:
            for i, seq in enumerate(sequences):
                chosen[i] = seq.sampler(logits[i])
        chosen = self.comm.broadcast_tokens(chosen)
        for i, seq in enumerate(sequences):
            token = int(chosen[i])
            if logits is not None and seq.request.return_logits:
                seq.step_logits.append(logits[i].cpu().clone())
            seq.generated.append(token)
            seq.tokens.append(token)
            params = seq.request.params
            if token in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.generated) >= params.max_new_tokens:
                seq.finish_reason = "length"

    def _register_full_pages(self, seq: Sequence) -> None:
        """Index every page whose tokens' KV are all written. The last token of
        `tokens` has no KV yet (it is fed at the next step)."""
        ps = self.page_size
        full = (len(seq.tokens) - 1) // ps
        if len(seq.keys) < full:
            seq.chain.extend(seq.tokens[len(seq.keys) * ps : full * ps])
        for index in range(seq.registered, full):
            self.pool.register(seq.pages[index], seq.keys[index])
        seq.registered = max(seq.registered, full)
        if self.draft is not None:
            self.draft.register(seq)
