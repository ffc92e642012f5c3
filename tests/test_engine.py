"""workers/engine.py: the engines implement the Protocols the workers rely on (no root)."""

import inspect

import pytest

from workers import engine
from workers.engine_profile import ProfileDecodeEngine, ProfilePrefillEngine


def _methods(proto):
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def _implements(cls, proto):
    """Every method of `proto` and its Protocol bases is defined by `cls` itself (or a real
    base), not inherited as the Protocol's empty body, with as many positional parameters."""
    for p in proto.__mro__:
        if p is object or not getattr(p, "_is_protocol", False):
            continue
        for name in _methods(p):
            impl = next((c.__dict__[name] for c in cls.__mro__
                         if name in c.__dict__ and not getattr(c, "_is_protocol", False)), None)
            assert impl is not None, f"{cls.__name__} lacks {name}"
            want = len(inspect.signature(getattr(p, name)).parameters)
            got = inspect.signature(impl).parameters.values()
            required = sum(1 for q in got if q.default is q.empty and q.kind in (
                q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD))
            assert required <= want <= len(got), (cls.__name__, name)
            assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(
                getattr(p, name)), (cls.__name__, name)


def test_profile_engines_implement_their_protocols():
    _implements(ProfilePrefillEngine, engine.PrefillEngine)
    _implements(ProfileDecodeEngine, engine.PacedDecodeEngine)
    assert engine.AssemblingDecodeEngine not in ProfileDecodeEngine.__mro__


def test_torch_decode_engine_implements_its_protocol():
    pytest.importorskip("torch")
    from workers.engine_torch import TorchDecodeEngine
    _implements(TorchDecodeEngine, engine.AssemblingDecodeEngine)
    assert engine.PacedDecodeEngine not in TorchDecodeEngine.__mro__


def test_a_slowed_decode_engine_stays_slow_after_a_request_frees_its_memory(tmp_path):
    """The `slow` fault sets clock_factor on the engine (workers/control.py); a request finishing
    (free) once reset it to 1, so a slowed decode instance recovered at its first completion."""
    rt = _small_runtime(tmp_path)
    eng = ProfileDecodeEngine(rt, rt.instance("ld0"))
    assert eng.clock_factor == 1.0
    eng.clock_factor = 3.0
    need = eng.kv_need(1000, 10)
    eng.reserve(need)
    eng.free(need)
    assert eng.clock_factor == 3.0 and eng.reserved == 0.0


def _small_runtime(tmp_path):
    """The compiled runtime of conftest's SMALL_EXPERIMENT (rp0 a PrfaaS prefill, ld0 decode)."""
    from conftest import SMALL_EXPERIMENT
    from testbed import config, deploy

    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT)
    (exp,) = config.load_experiment(p)
    return deploy.compile(exp).runtime


def test_workers_find_engine_capabilities_by_protocol(tmp_path):
    """The decode worker paces and admits by memory for a PacedDecodeEngine, hands frames to an
    AssemblingDecodeEngine; the prefill worker reads `frames_checksummed` (no getattr probing)."""
    import logging

    from workers.decode import DecodeService
    from workers.prefill import PrefillService, TorchPrefill

    rt = _small_runtime(tmp_path)
    eng = ProfileDecodeEngine(rt, rt.instance("ld0"))
    assert isinstance(eng, engine.DecodeEngine)
    svc = DecodeService(rt, "ld0", eng, logging.getLogger("t"))
    assert svc.paced and not svc.assembling
    pre = ProfilePrefillEngine(rt, rt.instance("rp0"))
    assert isinstance(pre, engine.PrefillEngine)
    assert PrefillService(rt, "rp0", pre, logging.getLogger("t")).frame_crc
    assert TorchPrefill.frames_checksummed and engine.PrefillEngine in TorchPrefill.__mro__


def test_a_profile_prefill_instance_keeps_its_schedule_across_queued_requests(tmp_path):
    """A request that arrived while the previous one computed starts when that compute was due
    to end (not when the event loop got round to it); an idle instance starts at once."""
    import asyncio
    import time

    from testbed.proto import testbed_pb2 as pb

    rt = _small_runtime(tmp_path)
    eng = ProfilePrefillEngine(rt, rt.instance("rp0"))
    req = pb.Request(id=1, input_len=1024, output_len=16)
    t = eng.compute_s(1024)
    emitted = []

    async def go():
        arrived = time.monotonic()
        a = await eng.prefill(req, lambda *x: emitted.append(time.time()), arrived)
        b = await eng.prefill(req, lambda *x: emitted.append(time.time()), arrived)  # queued
        await asyncio.sleep(2 * t)
        c = await eng.prefill(req, lambda *x: None, time.monotonic())              # idle
        return a, b, c, time.time()
    a, b, c, end = asyncio.run(go())
    assert b["start"] == pytest.approx(a["start"] + t, abs=1e-4)
    assert c["start"] >= b["start"] + 2 * t
    assert emitted[-1] >= b["start"] + t - 1e-4        # never before it is ready


def test_a_cancelled_prefill_hands_no_compute_time_to_the_next(tmp_path):
    """Cancelled half-way (its decode gave up), a prefill has used the instance until then: the
    request queued behind it starts at the cancel, not back-dated to the cancelled one's start
    (seen in a `reject` run: 220 KB of KV within 1 ms of the cancel)."""
    import asyncio
    import time

    from testbed.proto import testbed_pb2 as pb

    rt = _small_runtime(tmp_path)
    eng = ProfilePrefillEngine(rt, rt.instance("rp0"))
    req = pb.Request(id=1, input_len=4096, output_len=16)
    t = eng.compute_s(4096)

    async def go():
        arrived = time.monotonic()
        first = asyncio.ensure_future(eng.prefill(req, lambda *x: None, arrived))
        await asyncio.sleep(t / 2)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        cancelled_at = time.time()
        b = await eng.prefill(req, lambda *x: None, arrived)      # queued since `arrived`
        return b, cancelled_at, time.time()
    b, cancelled_at, end = asyncio.run(go())
    assert b["start"] >= cancelled_at - 0.01, (b["start"], cancelled_at)
    assert end - cancelled_at >= 0.9 * t             # its whole compute, none of it pre-paid
