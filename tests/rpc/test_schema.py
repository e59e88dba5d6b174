"""docs/serving-protocol.md lists the message types as they are declared."""

from kvrelay.rpc import schema
from kvrelay.rpc.worker_ops import Prefill


def test_the_protocol_doc_matches_the_types():
    text = schema.DOC.read_text()
    block = text[text.index(schema.BEGIN) : text.index(schema.END) + len(schema.END)]
    assert block == schema.generate(), "run: python -m kvrelay.rpc.schema"


def test_the_generated_tables_follow_the_types():
    line = schema.describe(Prefill)
    assert line.startswith('- `Prefill` (op "prefill"): {rid: str, tokens: bytes')
    assert "lease_s: float (gt 0, le 300.0) = 30.0" in line
