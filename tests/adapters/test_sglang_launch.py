"""An SGLang server whose port was taken while it imported (its HTTP server
then neither serves nor exits) is relaunched on a fresh port."""

from __future__ import annotations

import socket

from kvrelay.adapters.sglang.cpu.server import SGLangServer
from kvrelay.model import write_model
from tests.support.models import TINY


def test_a_server_whose_port_is_taken_comes_up_on_another(tmp_path):
    model_dir = write_model(tmp_path / "llama", TINY["serving"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = SGLangServer(model_dir, tmp_path / "sglang.log", l3="none",
                              hierarchical=False, port=taken, start_timeout_s=180.0)  # fmt: skip
        try:
            server.start()
            assert server.port != taken
            assert "address already in use" in (tmp_path / "sglang.log").read_text()
            assert len(server.generate(list(range(1, 40)), max_new_tokens=2).output_ids) == 2
        finally:
            server.stop()
