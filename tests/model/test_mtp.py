"""The MTP draft layer against transformers' own `MtpLayer` (float64, sdpa),
built over the target's decoder-layer class with the same weights: its logits
and its KV, position by position, for both RoPE position conventions."""

import pytest
import torch

from kvrelay.model import ModelConfig, ModelLoadError, Request, SamplingParams, load_engine
from kvrelay.model.mtp import mtp_prefix
from tests.model.oracle import hf_model
from tests.support.models import prompt_tokens

EXACT = 1e-9
PAGE = 16
PROMPT = 3 * PAGE + 5


@torch.no_grad()
def hf_mtp_run(model_dir, sequence: list[int], positions: str):
    """transformers' MtpLayer over the target's hidden states: slot i takes
    the target's final-normed h_i and token i + 1."""
    from safetensors.torch import load_file
    from transformers import DynamicCache
    from transformers.modeling_layers import MtpLayer

    target = hf_model(model_dir)
    config = ModelConfig.from_dir(model_dir)
    decoder = target.get_decoder()
    layer_cls = type(decoder.layers[-1])
    norm_cls = type(decoder.norm)
    ids = torch.tensor([sequence])
    hidden = decoder(ids[:, :-1]).last_hidden_state  # after the final norm
    mtp = MtpLayer(target.config, layer_cls, norm_cls, layer_idx=0).to(torch.float64).eval()
    prefix = mtp_prefix(config)
    stored = load_file(str(model_dir / "model.safetensors"))
    state = {}
    for name, tensor in stored.items():
        if not name.startswith(prefix):
            continue
        local = name.removeprefix(prefix)
        if local == "shared_head.norm.weight":
            local = "post_norm.weight"
        elif not local.startswith(("enorm", "hnorm", "eh_proj")):
            local = "mtp_block." + local
        state[local] = tensor.to(torch.float64)
    missing, unexpected = mtp.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    length = len(sequence) - 1
    position_ids = torch.arange(length)[None] + (1 if positions == "shifted" else 0)
    cos_sin = decoder.rotary_emb(hidden, position_ids=position_ids)
    cache = DynamicCache()
    out = mtp(
        decoder.embed_tokens(ids[:, 1:]),
        hidden,
        position_embeddings=cos_sin,
        attention_mask=None,
        position_ids=position_ids,
        cache=cache,
    )
    logits = target.lm_head(out)[0]
    return logits, cache.layers[0].keys[0], cache.layers[0].values[0]


@pytest.mark.parametrize("positions", ["target", "shifted"])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mha"])
def test_mtp_logits_and_kv_match_hf_mtp_layer(model_dirs, name, positions):
    model_dir = model_dirs(name, mtp=1)
    prompt = prompt_tokens(PROMPT, seed=7)
    engine = load_engine(
        model_dir,
        dtype="float64",
        page_size=PAGE,
        num_pages=32,
        speculative=1,
        mtp_positions=positions,
    )
    engine.admit(Request(prompt, SamplingParams(4), return_logits=True))
    engine.step()  # the prefill: the draft runs over the prompt and the first token
    seq = engine._active[0]
    sequence = list(seq.tokens)  # prompt + first token
    logits, keys, values = hf_mtp_run(model_dir, sequence, positions)
    draft = seq.draft
    assert draft.length == PROMPT
    assert float((draft.prompt_logits - logits).abs().max()) < EXACT
    pool = engine.draft.pool
    slots = pool.slots(draft.pages, PROMPT)
    ours_k = pool.k_layers[0][slots].transpose(0, 1)  # [heads, slots, head_dim]
    ours_v = pool.v_layers[0][slots].transpose(0, 1)
    assert float((ours_k - keys).abs().max()) < EXACT
    assert float((ours_v - values).abs().max()) < EXACT
    engine.cancel(seq.seq_id)


def test_speculation_without_an_mtp_layer_is_refused(model_dirs):
    with pytest.raises(ModelLoadError, match="MTP layer"):
        load_engine(model_dirs("llama-gqa"), speculative=2)


def test_make_model_keeps_the_target_and_adds_deepseek_tensors(model_dirs):
    from safetensors.torch import load_file

    plain = load_file(str(model_dirs("qwen2-gqa") / "model.safetensors"))
    with_mtp = load_file(str(model_dirs("qwen2-gqa", mtp=1) / "model.safetensors"))
    config = ModelConfig.from_dir(model_dirs("qwen2-gqa", mtp=1))
    assert config.num_mtp_layers == 1
    extra = sorted(set(with_mtp) - set(plain))
    prefix = mtp_prefix(config)
    assert all(n.startswith(prefix) for n in extra)
    for local in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert prefix + local in extra
    assert all(torch.equal(plain[n], with_mtp[n]) for n in plain)
