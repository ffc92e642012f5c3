"""workers/stepclock.py: the paced clock's run of steps between two wake-ups (`PacedClock._run`,
`DecodeService.emit_run`) gives what one `emit` per step gives (`_step_each`): the same stamps
on every request, the same token messages, flushes, wake-ups and busy time. No root, no loop."""

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
