"""kvrelay: move and reuse LLM KV cache between prefill, decode and a shared cache tier."""

# The compiled module kvrelay._C links against libtorch; importing torch first
# loads those libraries, so `import kvrelay._C` works on its own.
import torch as _torch  # noqa: F401

__version__ = "0.1.0"
