"""kvrelay as vLLM's KV connector (`connector.KvrelayConnector`).

Only `connector.py` imports vLLM at module level, so the rest is importable
(and unit-tested) without it.
"""
