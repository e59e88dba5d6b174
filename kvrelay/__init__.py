"""kvrelay: move and reuse LLM KV cache between prefill, decode and a shared cache tier."""

__version__ = "0.1.0"
