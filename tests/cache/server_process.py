"""Cache server processes started through the CLI (`kvrelay launch cache`), for tests."""

from kvrelay.cache.launch import CacheServerProcess
from tests.cache.specs import SPEC

TOKEN = "cache-test"
PAGE = SPEC.page_bytes


class ServerProcess(CacheServerProcess):
    def __init__(
        self, *args: str, listen: str = "127.0.0.1:0", backend: str = "tcp", pages: int = 64
    ) -> None:
        super().__init__(
            *args, token=TOKEN, page_bytes=PAGE, pages=pages, listen=listen, backend=backend
        )
