"""SGLang's `torch_native` attention for EAGLE / MTP chains (topk 1).

SGLang's speculative worker runs three kinds of forward besides prefill and
decode, and `torch_native` serves none of them as it stands:

* target verify (`TARGET_VERIFY`): the batch carries no extend lengths, so
  they are derived here as the CPU AMX backend does: each request extends
  its committed `seq_lens` by the `draft_token_num` tokens of its chain.
  A chain's tree mask is the causal mask `torch_native` applies already.
* the draft's extend (`DRAFT_EXTEND_V2`, and the draft's own prefill): an
  ordinary extend over the draft's pool, a plain `torch_native` backend.
* the draft's decode steps: step i's query (written at `seq_lens + i`)
  sees `seq_lens + i + 1` slots, one backend per step.

SGLang's draft backend factory knows no `torch_native` entry and would
refuse the draft; `draft_backend_entry` is the entry it is given. Trees
(topk > 1) need a mask per node and per-branch KV rows in the draft steps,
which `torch_native` does not have: they are refused when the draft starts.
"""

from __future__ import annotations

import copy

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

_extend = TorchNativeAttnBackend.forward_extend


def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
    """`TorchNativeAttnBackend.forward_extend`, target verify included."""
    if not forward_batch.forward_mode.is_target_verify():
        return _extend(self, q, k, v, layer, forward_batch, save_kv_cache)
    spec = forward_batch.spec_info
    if getattr(spec, "tree_topk", 1) != 1:
        raise NotImplementedError("torch_native verifies draft chains only (topk 1)")
    # A shallow copy with extend fields: the batch itself stays as SGLang made it.
    batch = copy.copy(forward_batch)
    committed = forward_batch.seq_lens
    batch.extend_prefix_lens = committed
    batch.extend_seq_lens = torch.full_like(committed, spec.draft_token_num)
    batch.seq_lens = committed + spec.draft_token_num
    return _extend(self, q, k, v, layer, batch, save_kv_cache)


class DraftStepBackend(TorchNativeAttnBackend):
    """Draft decode step `step`: its query sees the committed slots and the
    draft tokens of steps 0..step (its own included)."""

    def __init__(self, model_runner, step: int) -> None:
        super().__init__(model_runner)
        self.step = step

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        batch = copy.copy(forward_batch)
        batch.seq_lens = forward_batch.seq_lens + self.step + 1
        return super().forward_decode(q, k, v, layer, batch, save_kv_cache)


class DraftSteps:
    """The per-step backends of a chain draft's decode steps (SGLang's
    multi-step draft backends have the same face: `attn_backends` and one
    `init_forward_metadata` for all steps)."""

    def __init__(self, model_runner, topk: int, num_steps: int) -> None:
        self.topk = topk
        self.speculative_num_steps = num_steps
        self.attn_backends = [DraftStepBackend(model_runner, i) for i in range(num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def draft_backend_entry(factory, stamps_children: bool):
    """The `torch_native` entry of SGLang's draft backend maps: the multi-step
    decode container (`stamps_children`) or the draft-extend backend."""
    if factory.topk != 1:
        raise NotImplementedError(
            "speculative decoding on torch_native attention drafts chains only: "
            "--speculative-eagle-topk 1"
        )
    runner = factory.draft_model_runner
    if stamps_children:
        return "torch_native", DraftSteps(runner, factory.topk, factory.speculative_num_steps)
    return "torch_native", TorchNativeAttnBackend(runner)
