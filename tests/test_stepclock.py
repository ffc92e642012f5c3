"""workers/stepclock.py: the paced clock's run of steps between two wake-ups (`PacedClock._run`,
`DecodeService.emit_run`) gives what one `emit` per step gives (`_step_each`): the same stamps
on every request, the same token messages, flushes, wake-ups and busy time. No root, no loop."""

import asyncio
import copy
import logging
import time

from conftest import SMALL_EXPERIMENT
from testbed import config, deploy
from workers.decode import DecodeService
from workers.engine_profile import ProfileDecodeEngine
from workers.kvintake import Slot

# Unix time - monotonic time as `_next_event` reads it, fixed here so both sides stamp alike
OFFSET = time.time() - time.monotonic()
START = time.monotonic()


class Stream:
    """A token stream that keeps what it was sent."""

    def __init__(self):
        self.sent = []

    def send_batch(self, batch):
        self.sent.append([(c.id, c.first_index, list(c.times)) for c in batch.chunks])


def _runtime(tmp_path):
    """conftest's small experiment at scale.time 40, where one wake-up runs several steps."""
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT)
    (exp,) = config.load_experiment(p, ["scale.time=40"])
    return deploy.compile(exp).runtime


def _service(tmp_path, slots, streams=("c",)):
    rt = _runtime(tmp_path)
    svc = DecodeService(rt, "ld0", ProfileDecodeEngine(rt, rt.instance("ld0")),
                        logging.getLogger("t"))
    svc.token_streams = {c: Stream() for c in streams}
    for rid, (client, done, output_len) in enumerate(slots):
        s = Slot(rid)
        s.client, s.input_len, s.output_len = client, 1000 + 500 * rid, output_len
        s.times = [OFFSET + START - 0.001 * (done - i) for i in range(done)]
        s.emitted = done
        svc.batch.append(s)
    svc.last_flush = OFFSET + START
    return svc


def _state(svc):
    return ([(s.rid, s.times, s.emitted, s.wake.is_set(), s.finished) for s in svc.batch],
            {c: st.sent for c, st in svc.token_streams.items()}, round(svc.busy_s, 12),
            svc.clock.steps, svc.last_flush, dict(svc.slot_flush))


def _drive(svc, ref, wakeups=400, late_s=0.0003, beyond_s=0.0):
    """Wake-ups on one schedule for both services: `svc` steps by runs, `ref` one step each.
    `beyond_s`: each run goes that far past the next event (flushes fall inside it)."""
    next_tick = [START, START]
    for _ in range(wakeups):
        if not ref.batch:
            break
        end = ref.clock._next_event(next_tick[1]) + beyond_s
        now = end + OFFSET + late_s
        next_tick[0] = svc.clock._run(next_tick[0], end, now, OFFSET)
        next_tick[1] = ref.clock._step_each(next_tick[1], end, now, OFFSET)
        assert _state(svc) == _state(ref)
        for s in svc.batch + ref.batch:
            s.wake.clear()          # what the request's Decode stream does
    return next_tick


def test_a_run_of_steps_is_the_same_as_one_emit_per_step(tmp_path):
    slots = [("c", 1, 400), ("c", 30, 120), ("c", 5, 90), ("", 12, 200)]
    svc = _service(tmp_path, slots)
    ref = _service(tmp_path, slots)
    _drive(svc, ref)
    assert not ref.batch and svc.clock.steps > 300
    sent = sum(len(b) for b in ref.token_streams["c"].sent)
    assert sent > 10        # flushes happened inside the compared runs


def test_a_flush_inside_a_run_is_sent_at_its_step(tmp_path):
    """The clock ends a run at a flush (`_next_event`); were one inside, it goes out as before."""
    slots = [("c", 3, 5000), ("c", 40, 5000), ("", 9, 5000)]
    svc, ref = _service(tmp_path, slots), _service(tmp_path, slots)
    _drive(svc, ref, wakeups=30, beyond_s=0.02)
    assert len(ref.token_streams["c"].sent) >= 5 and ref.slot_flush


def test_a_first_token_and_a_cancelled_request_take_the_step_by_step_path(tmp_path):
    slots = [("c", 0, 50), ("c", 3, 60), ("c", 8, 70)]
    svc, ref = _service(tmp_path, slots), _service(tmp_path, slots)
    assert svc.steady()
    svc.batch[2].finished = ref.batch[2].finished = True      # its stream was cancelled
    assert not svc.steady()
    # the clock takes `_step_each` for a batch that is not steady: compare that with itself
    # after the cancelled request left, then runs again
    end = ref.clock._next_event(START)
    for s in (svc, ref):
        s.clock._step_each(START, end, end + OFFSET, OFFSET)
    assert svc.steady() and len(svc.batch) == 2
    _drive(svc, ref)


def test_copies_share_nothing(tmp_path):
    """The fixture's two services are independent (a check of the comparison itself)."""
    slots = [("c", 2, 10)]
    a, b = _service(tmp_path, slots), _service(tmp_path, slots)
    a.batch[0].times.append(0.0)
    assert b.batch[0].times != a.batch[0].times
    assert copy.copy(a.batch[0].times) == a.batch[0].times


def test_a_fast_tail_runs_a_batch_out_and_samples_no_wake_up(tmp_path):
    """A pilot step's tail (testbed/run.py `TAIL_FACTOR`): the same steps, 1000x closer, at a
    few wake-ups, and none of them is a lateness sample (it is not the emulated system)."""
    from testbed.run import TAIL_FACTOR
    slots = [("c", 1, 300), ("c", 4, 200)]
    svc = _service(tmp_path, slots)
    svc.clock._late(0.002)      # one wake-up before the cut, sampled
    svc.clock.factor = svc.engine.clock_factor = TAIL_FACTOR    # as the loop reads it
    tick, wakeups = START, 0
    while svc.batch and wakeups < 50:
        end = svc.clock._next_event(tick)
        svc.clock._late(0.5)    # however late: not sampled
        tick = svc.clock._run(tick, end, end + OFFSET, OFFSET) if svc.steady() else \
            svc.clock._step_each(tick, end, end + OFFSET, OFFSET)
        for s in svc.batch:
            s.wake.clear()
        wakeups += 1
    assert not svc.batch and wakeups <= 5 and svc.clock.steps == 299
    assert svc.clock.lateness == [0.002] and svc.clock.wakeups == 1
    full = sum(svc.engine.step_seconds(2, 2000) for _ in range(10))      # 10 modelled steps
    assert tick - START < full     # 299 steps in less than 10 take at the model's speed


def test_a_new_clock_factor_stamps_no_step_before_it_was_set(tmp_path):
    """The paced loop running: the factor drops to the tail's while it sleeps; every step
    stamped at the new factor (1000x closer) comes after the moment it was set, and the steps
    before keep the modelled spacing."""
    from testbed.run import TAIL_FACTOR
    svc = _service(tmp_path, [("c", 1, 3000), ("c", 2, 3000)])
    slots = list(svc.batch)
    svc.clock.factor = svc.engine.clock_factor = 1.0
    model_s = svc.engine.step_seconds(2, 2000)

    async def drive():
        task = asyncio.create_task(svc.clock.run())
        await asyncio.sleep(0.05)
        set_at = time.time()
        svc.engine.clock_factor = TAIL_FACTOR       # what workers/control.py does
        while svc.batch:
            await asyncio.sleep(0.01)
        task.cancel()
        return set_at

    set_at = asyncio.run(drive())
    times = slots[0].times
    # the 20 ms before the change hold the steps the model gives them (~60; at the new factor
    # thousands would fit), and the rest of the 3000 came after it
    before = [t for t in times if set_at - 0.02 <= t < set_at]
    assert len(times) == 3000 and 20 < len(before) < 1.5 * 0.02 / model_s + 10
    assert sum(t >= set_at for t in times) > 2000
