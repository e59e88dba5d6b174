"""kvrelay: move and reuse LLM KV cache between prefill, decode and a shared cache tier."""

# No imports here: the control process imports kvrelay.control without torch
# (kvrelay.cuda_ext imports torch itself before the compiled kvrelay._C).

__version__ = "0.1.0"
