"""Reference decoder (Llama / Qwen2) with a paged KV pool, prefix reuse, TP and PP."""

from kvrelay.model.config import ModelConfig
from kvrelay.model.engine import Engine, Request, Result
from kvrelay.model.errors import ModelLoadError, PoolExhausted, RequestError
from kvrelay.model.loader import kv_spec, load_engine
from kvrelay.model.make_model import RandomModelSpec, write_model
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.parallel import ParallelEngine
from kvrelay.model.pool import PagedKVPool
from kvrelay.model.sampling import SamplingParams

__all__ = [
    "Engine",
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
    "load_engine",
    "write_model",
]
