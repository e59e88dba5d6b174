"""Reference decoders (Llama / Qwen2; GLM-5 / DeepSeek-V3.2 / DeepSeek-V3 with MLA,
DSA and MoE) over paged KV pools, with prefix reuse, TP, PP, CP and MTP drafts."""

from kvrelay.model.config import ModelConfig
from kvrelay.model.engine import Engine, Request, Result
from kvrelay.model.errors import ModelLoadError, PoolExhausted, RequestError
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.loader import kv_spec, load_config, load_engine, model_kv_spec
from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model
from kvrelay.model.make_model import RandomModelSpec, write_model
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from kvrelay.model.pool import PagedKVPool
from kvrelay.model.sampling import SamplingParams

__all__ = [
    "Engine",
    "LatentKVPool",
    "MlaConfig",
    "MlaModelSpec",
    "ModelConfig",
    "ModelLoadError",
    "PagedKVPool",
    "ParallelEngine",
    "PoolExhausted",
    "RandomModelSpec",
    "Request",
    "RequestError",
    "Result",
    "SamplingParams",
    "export_prefix",
    "import_prefix",
    "kv_spec",
    "load_config",
    "load_engine",
    "model_kv_spec",
    "write_mla_model",
    "write_model",
]
