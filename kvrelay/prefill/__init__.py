"""The prefill worker (docs/serving-protocol.md)."""
