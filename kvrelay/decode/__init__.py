"""The decode worker (docs/serving-protocol.md)."""
