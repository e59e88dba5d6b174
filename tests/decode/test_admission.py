"""The decode front's admission: a request whose pages or staging rows are
not free now waits while something will give them back, and fails only
when nothing will (`kvrelay bench chaos` found full_decode_pool requests
failing with 503 while finished sequences' write-backs held the rows)."""

from __future__ import annotations

import pytest

from kvrelay.decode.worker import DecodeWorker, _Job
from kvrelay.model.errors import PoolExhausted
from kvrelay.rpc import Error
from kvrelay.rpc.worker_ops import Decode
from kvrelay.worker.config import WorkerConfig


def front_out_of_room() -> tuple[DecodeWorker, _Job, list]:
    worker = DecodeWorker(WorkerConfig(model_dir="unused", token="t"))
    asked = []

    async def ranks(message):  # every rank: the room is not there now
        asked.append(message)
        raise PoolExhausted(34, 128)

    worker.ranks = ranks
    job = _Job("r1", Decode("r1", bytes(4 * 40), 7, 3), 40)
    worker._waiting.append(job)
    return worker, job, asked


@pytest.mark.asyncio
@pytest.mark.parametrize("holder", ["_running", "_loading", "_writing"])
async def test_waits_while_sequences_loads_or_write_backs_hold_room(holder):
    worker, job, asked = front_out_of_room()
    getattr(worker, holder)[5] = _Job("r0", Decode("r0", bytes(4 * 20), 7, 2), 20)
    await worker._start_loads()
    assert len(asked) == 1
    assert list(worker._waiting) == [job] and worker._blocked
    assert job.frames.empty()  # not failed: it is admitted once the room comes back


@pytest.mark.asyncio
async def test_fails_when_nothing_will_give_room_back():
    worker, job, _ = front_out_of_room()
    await worker._start_loads()
    assert not worker._waiting
    reply = job.frames.get_nowait()
    assert isinstance(reply, Error) and reply.error == "PoolExhausted"
