"""The control endpoint: OpenAI-style HTTP edge, worker registry, cache-aware dispatch.

Talks to prefill/decode workers over msgpack frames only (docs/serving-protocol.md).
"""
