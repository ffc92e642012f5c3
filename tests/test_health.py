"""The scheduler's health checks (workers/recovery.Health) on fake instances, no root: two missed
checks in a row mark an instance down, an answer marks it up, and a late answer from an instance
whose tokens keep arriving is not a miss (a loaded decode worker is not a dead one)."""

import asyncio
import types

import grpc
import pytest

from testbed.runtime import SchedulerRuntime, WorkerRuntime
from workers.policy import Instance
from workers.recovery import Health


class _Late(grpc.aio.AioRpcError):
    def __init__(self):
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "late")


class _Stub:
    """Answers Health, or fails it as a timeout when `late`."""
    def __init__(self):
        self.late = False

    async def Health(self, request, timeout):
        if self.late:                           # no answer within the deadline
            await asyncio.sleep(timeout)
            raise _Late()
        await asyncio.sleep(0)


def _service(tmp_path):
    d = Instance(name="ld0", role="decode", dc="local", accelerator="h20", addr="x:1")
    (tmp_path / "ready").mkdir()
    (tmp_path / "ready" / "ld0").touch()
    rt = WorkerRuntime(run_dir=str(tmp_path),
                       scheduler=SchedulerRuntime(health_interval_s=0.02, health_timeout_s=0.05))
    svc = types.SimpleNamespace(rt=rt, router=types.SimpleNamespace(remote=[], local=[], decode=[d]),
                                prefill_stub={}, decode_stub={"ld0": _Stub()},
                                stats=types.SimpleNamespace(failovers=0))
    svc.health = Health(svc, rt, types.SimpleNamespace(warning=lambda *a: None))
    return svc, d


async def _run_for(health, seconds, during=None):
    task = asyncio.create_task(health.loop())
    t_end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < t_end:
        if during:
            during()
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_late_answers_without_traffic_mark_down_and_an_answer_marks_up(tmp_path):
    svc, d = _service(tmp_path)

    async def main():
        svc.decode_stub["ld0"].late = True
        await _run_for(svc.health, 0.3)
        assert d.down
        svc.decode_stub["ld0"].late = False
        await _run_for(svc.health, 0.1)
        assert not d.down
    asyncio.run(main())
    events = (tmp_path / "events.csv").read_text()
    assert "state=down" in events and "state=up" in events


def test_late_answers_while_tokens_flow_are_not_misses(tmp_path):
    svc, d = _service(tmp_path)

    async def main():
        svc.decode_stub["ld0"].late = True
        await _run_for(svc.health, 0.3, during=lambda: svc.health.seen(d))
        assert not d.down
    asyncio.run(main())


def test_tokens_that_stop_when_it_freezes_do_not_delay_detection(tmp_path):
    svc, d = _service(tmp_path)

    async def main():
        svc.decode_stub["ld0"].late = True
        svc.health.seen(d)                      # its last chunk, just before it froze
        await _run_for(svc.health, 0.3)
        assert d.down
    asyncio.run(main())
