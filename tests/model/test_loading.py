"""Model directories: config parsing, safetensors (single and sharded), and
clear errors naming the file and tensor for anything wrong."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.model import ModelConfig, ModelLoadError, RandomModelSpec, load_engine, write_model
from kvrelay.model.config import ModelConfig as Config


@pytest.fixture
def model_dir(tmp_path):
    return write_model(tmp_path / "m", RandomModelSpec(arch="llama", layers=2, seed=3))


def rewrite_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(config))


def test_config_reads_hf_fields(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert (config.arch, config.num_layers, config.hidden_size) == ("llama", 2, 64)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.group_size == 2 and not config.qkv_bias


def test_qwen2_has_qkv_bias_and_rope_parameters_are_read():
    raw = RandomModelSpec(arch="qwen2").config_json()
    raw.pop("rope_theta")
    raw["rope_scaling"] = None
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    config = Config.from_dict(raw)
    assert config.qkv_bias and not config.o_bias
    assert config.rope_theta == 1e6 and config.rope_type == "linear"


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_engine(tmp_path / "nope")


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty/config.json: no config.json"):
        load_engine(tmp_path / "empty")


def test_bad_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config.json: cannot read JSON"):
        load_engine(model_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"num_hidden_layers": None}, "bad value"),
        ({"num_attention_heads": 3}, "not a multiple of"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs.*low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"use_sliding_window": True}, "sliding-window attention is not supported"),
    ],
)
def test_bad_config_values(model_dir, changes, message):
    rewrite_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_engine(model_dir)


def test_missing_field(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="missing field 'hidden_size'"):
        load_engine(model_dir)


def test_no_weight_files(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors files"):
        load_engine(model_dir)


def test_missing_tensor_is_named(model_dir):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_engine(model_dir)


def test_shape_mismatch_names_file_and_tensor(model_dir):
    rewrite_config(model_dir, intermediate_size=100)
    with pytest.raises(
        ModelLoadError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape "
        r"\(128, 64\), config says \(100, 64\)",
    ):
        load_engine(model_dir)


def test_corrupt_weight_file_is_named(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model.safetensors: not a readable safetensors"):
        load_engine(model_dir)


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path):
    spec = RandomModelSpec(arch="qwen2", layers=2, seed=4)
    single = write_model(tmp_path / "single", spec)
    sharded = write_model(tmp_path / "sharded", replace(spec, shards=3))
    assert len(list(sharded.glob("*.safetensors"))) == 3
    prompt = list(range(20))
    from kvrelay.model import Request, SamplingParams

    want = load_engine(single, dtype="float64").generate([Request(prompt, SamplingParams(5))])
    got = load_engine(sharded, dtype="float64").generate([Request(prompt, SamplingParams(5))])
    assert got[0].tokens == want[0].tokens
    shutil.move(sharded / "model-00002-of-00003.safetensors", tmp_path / "elsewhere")
    with pytest.raises(ModelLoadError, match=r"lists model-00002-of-00003\.safetensors"):
        load_engine(sharded)


def test_weights_in_half_precision_load_in_any_dtype(tmp_path):
    directory = write_model(tmp_path / "bf16", RandomModelSpec(dtype="bfloat16", seed=5))
    engine = load_engine(directory, dtype="float64")
    assert engine.pool.dtype == torch.float64
    assert engine.shard.weights.layers[0].q_proj.dtype == torch.float64


def test_bad_dtype_and_parallel_sizes(model_dir):
    from kvrelay.layout import ParallelConfig

    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        load_engine(model_dir, dtype="int8")
    with pytest.raises(ModelLoadError, match="tp=3 does not divide 4 attention heads"):
        load_engine(model_dir, parallel=ParallelConfig(tp=3))
    with pytest.raises(ModelLoadError, match="tp=8 does not divide 4 attention heads"):
        load_engine(model_dir, parallel=ParallelConfig(tp=8))


def test_fingerprint_follows_the_weights(tmp_path):
    a = load_engine(write_model(tmp_path / "a", RandomModelSpec(seed=1))).spec
    b = load_engine(write_model(tmp_path / "b", RandomModelSpec(seed=2))).spec
    a2 = load_engine(write_model(tmp_path / "a2", RandomModelSpec(seed=1))).spec
    assert a.weights_fingerprint == a2.weights_fingerprint != b.weights_fingerprint
    assert a.namespace() != b.namespace()
