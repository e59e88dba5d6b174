"""The MLA family's config.json as transformers reads it: per-layer indexer
and MLP patterns derived the same way, and configs the runner cannot run
refused by name."""

import pytest

from kvrelay.model import ModelLoadError
from kvrelay.model.make_mla_model import MlaModelSpec
from kvrelay.model.mla_config import MlaConfig


def glm5_raw(**fields) -> dict:
    raw = MlaModelSpec(arch="glm5", layers=7).config_json()
    for name in ("index_topk_freq", "index_skip_topk_offset"):
        raw.pop(name)
    return raw | fields


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"index_topk_freq": 2},
        {"index_topk_freq": 3, "index_skip_topk_offset": 1},
        {"index_topk_pattern": "FFSFSSF"},
        {"indexer_types": ["full", "shared", "full", "full", "shared", "full", "shared"]},
        {"first_k_dense_replace": 3},
        {"mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse", "sparse", "dense"]},
    ],
)
def test_glm5_patterns_are_transformers(fields):
    from transformers import GlmMoeDsaConfig

    raw = glm5_raw(**fields)
    ours = MlaConfig.from_dict(raw)
    theirs = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert list(ours.indexer_types) == theirs.indexer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.index_layers == tuple(i for i, t in enumerate(theirs.indexer_types) if t == "full")


def test_deepseek_patterns():
    v32 = MlaConfig.from_dict(MlaModelSpec(arch="deepseek_v32", layers=4).config_json())
    assert v32.indexer_types == ("full",) * 4 and not v32.indexer_rope_interleave
    v3 = MlaConfig.from_dict(MlaModelSpec(arch="deepseek_v3", layers=4).config_json())
    assert v3.indexer_types == () and v3.index_layers == () and not v3.has_indexer
    assert v3.mlp_layer_types == ("dense",) + ("sparse",) * 3
    assert v3.latent_dim == 32 + 16 and v3.head_dim == 16


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_topk_pattern": "SFF" + "F" * 4}, "first layer's indexer"),
        ({"n_group": 3}, "n_group"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_unsupported_configs_are_refused(fields, message):
    with pytest.raises(ModelLoadError, match=message):
        MlaConfig.from_dict(glm5_raw(**fields))
