"""The mixture of experts of the DeepSeek-V3 family, as transformers computes it.

Routing (replicated on every TP rank, float32 whatever the model dtype):
sigmoid scores; `e_score_correction_bias` added for the choice only; groups
ranked by the sum of their two best biased scores, the best `topk_group`
groups kept; the top `num_experts_per_tok` experts among them; their
unbiased scores as weights, normalised when `norm_topk_prob`, times
`routed_scaling_factor`.

Experts run in increasing index order and their weighted outputs are added
into a zero tensor in that order, as transformers' eager experts do, so each
row's sum is the same sum. Under TP every expert (and the shared experts)
holds a slice of its intermediate columns: the result is a partial sum the
decoder all-reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.mla_weights import MoeWeights


def route(x: torch.Tensor, w: MoeWeights, config: MlaConfig):
    """(top-k weights float32 [rows, k], expert indices int64 [rows, k])."""
    experts, groups = config.n_routed_experts, config.n_group
    scores = F.linear(x.float(), w.gate).sigmoid()
    choice = scores + w.bias
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=config.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, indices


def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe_forward(x: torch.Tensor, w: MoeWeights, config: MlaConfig) -> torch.Tensor:
    """This rank's partial MoE output (routed experts plus shared experts)."""
    weights, indices = route(x, w, config)
    out = torch.zeros_like(x)
    for expert in torch.unique(indices).tolist():
        rows, slot = torch.where(indices == expert)
        part = mlp(x[rows], w.gate_proj[expert], w.up_proj[expert], w.down_proj[expert])
        out.index_add_(0, rows, (part * weights[rows, slot, None]).to(out.dtype))
    if w.shared is not None:
        out = out + mlp(x, *w.shared)
    return out
