import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kvrelay.control.app import ControlConfig, create_app
from tests.control.fakes import TOKEN, FakeWorker

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class LoopThread:
    """An event loop in a thread: home of the fake workers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Control:
    """The real app under real uvicorn on a free loopback port, in a thread."""

    def __init__(self, **overrides) -> None:
        settings = {"token": TOKEN, "heartbeat_s": 0.5, "request_timeout_s": 10.0, "lease_s": 5.0}
        self.config = ControlConfig(**(settings | overrides))
        self.app = create_app(self.config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("control did not start")
            time.sleep(0.01)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    @property
    def registry(self):
        return self.app.state.registry

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture
def loop_thread():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def cluster(loop_thread):
    """make(**control settings) -> Control; worker(role, **kw) -> a started FakeWorker."""
    controls: list[Control] = []
    workers: list[FakeWorker] = []

    class Cluster:
        loop = loop_thread

        def control(self, **overrides) -> Control:
            controls.append(Control(**overrides))
            return controls[-1]

        def worker(self, role: str, control: Control | None = None, **kw) -> FakeWorker:
            control = control or controls[-1]
            worker = FakeWorker(role, control.url, **kw)
            workers.append(worker)
            return loop_thread.run(worker.start())

    yield Cluster()
    for worker in workers:
        loop_thread.run(worker.stop())
    for control in controls:
        control.close()


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
