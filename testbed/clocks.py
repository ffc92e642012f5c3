"""Clocks across hosts: each host's wall clock measured against the orchestrator's, and the
per-phase timestamps of a run's records put on one clock when analysed.

    run: backend measures offsets (start, end of a variant) -> metadata.json `clocks`
    analyse: requests.jsonl (raw, each stamp on its host's clock) -> `records.read_records` -> tables

Every process of the testbed stamps with `time.time()` (CLOCK_REALTIME, the clock that can be
compared between machines). A request's record mixes stamps of several hosts: the client's
(send, token arrivals), the prefill worker's (queued, start, end, KV send), the decode
worker's (KV arrival, batch join, every token) and the scheduler's (re-dispatches). TTFT,
E2EL and ITL at the client are differences of the client's own stamps and need no correction;
stamps of other hosts are compared with them (the KV's arrival against the prefill's end,
the token's decode stamp against its arrival at the client) and with the orchestrator's
(events.csv, timeseries.csv), so analysis moves each onto the orchestrator's clock:
`reference = stamp - offset(host)`.

The offset is measured NTP-style (`measure`): the orchestrator reads its clock (t0), asks the
host's clock (r), reads its clock again (t1), several times; the round trip with the smallest
t1 - t0 bounds the error best, and `offset = r - (t0 + t1) / 2` is within `rtt / 2` of the truth
whatever the asymmetry of the two legs (`estimate`). It is measured at the start and at the end
of each variant; analysis applies the mean of both (one offset per host, so differences of one
host's stamps are kept exactly) and the record says the drift between them.

On the Mininet backend every instance is a namespace of one machine: one clock, offsets 0 by
construction (`one_clock`).

`TESTBED_CLOCK_SKEW_S` (test only): a host whose environment sets it runs its clock that many
seconds ahead (`apply_test_skew` in every worker process, `wall` in the Ray launcher), so a
test can check that the measured offset recovers a known skew; a run with it set says so in
metadata.json (`injected_skew_s`) and in its summary's warnings. It is a Ray node's own
setting: the runner drops the orchestrator's from every worker's environment (a Mininet run
never runs skewed) and the launcher puts back its node's (`worker_env`).
"""

from __future__ import annotations

import dataclasses
import os
import time

SKEW_ENV = "TESTBED_CLOCK_SKEW_S"
ROUNDS = 16



# ---------------------------------------------------------------- the test-only skew

def test_skew_s(environ=None) -> float:
    """The skew `TESTBED_CLOCK_SKEW_S` asks for (0 when unset); ValueError when malformed."""
    raw = (os.environ if environ is None else environ).get(SKEW_ENV, "")
    if not raw:
        return 0.0
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{SKEW_ENV}={raw!r} is not a number of seconds") from None


def wall() -> float:
    """This host's wall clock as its workers stamp it (with the test-only skew, if set)."""
    return time.time() + test_skew_s()


def apply_test_skew() -> float:
    """In a worker process: make `time.time` run `TESTBED_CLOCK_SKEW_S` ahead, as a host whose
    clock is off would (nothing happens when unset); the skew."""
    skew = test_skew_s()
    if skew:
        real, real_ns = time.time, time.time_ns
        time.time = lambda: real() + skew
        time.time_ns = lambda: real_ns() + round(skew * 1e9)
    return skew


def worker_env(env, node_environ=None) -> dict:
    """`env` (the orchestrator's, for a worker) with this node's own test-only skew setting in
    place of the orchestrator's: the skew belongs to a host, never to a run."""
    out = dict(env)
    out.pop(SKEW_ENV, None)
    own = (os.environ if node_environ is None else node_environ).get(SKEW_ENV)
    if own:
        out[SKEW_ENV] = own
    return out


# ---------------------------------------------------------------- the estimator

@dataclasses.dataclass(frozen=True)
class Sample:
    """One round trip: the reference clock before (t0) and after (t1), the host's between."""

    t0: float
    remote: float
    t1: float

    @property
    def rtt(self) -> float:
        return self.t1 - self.t0


def estimate(samples) -> dict:
    """The host's offset from the round trip with the smallest RTT: `offset_s` (host -
    reference), `uncertainty_s` (rtt / 2: the true offset lies within it), `rtt_s`, `samples`,
    `at` (the reference time of that sample)."""
    samples = list(samples)
    if not samples:
        raise ValueError("no clock samples")
    best = min(samples, key=lambda s: s.rtt)
    mid = (best.t0 + best.t1) / 2
    rtts = sorted(s.rtt for s in samples)
    return {"offset_s": best.remote - mid, "uncertainty_s": best.rtt / 2, "rtt_s": best.rtt,
            "rtt_median_s": rtts[len(rtts) // 2], "samples": len(samples), "at": mid}


def measure(remote_clock, rounds=ROUNDS, clock=time.time) -> dict:
    """`estimate` over `rounds` round trips of `remote_clock()` (a call that returns the host's
    wall clock, e.g. a Ray actor method)."""
    samples = []
    for _ in range(rounds):
        t0 = clock()
        r = remote_clock()
        samples.append(Sample(t0, float(r), clock()))
    return estimate(samples)


def combine(start: dict, end: dict | None = None, injected_skew_s=0.0) -> dict:
    """One host's record: both measurements, the offset analysis applies (their mean), its
    uncertainty (the larger one plus half the drift) and the drift between them."""
    out = {"start": start}
    if end is None:
        out.update(offset_s=start["offset_s"], uncertainty_s=start["uncertainty_s"],
                   drift_s=None)
    else:
        drift = end["offset_s"] - start["offset_s"]
        out.update(end=end, offset_s=(start["offset_s"] + end["offset_s"]) / 2,
                   uncertainty_s=max(start["uncertainty_s"], end["uncertainty_s"])
                   + abs(drift) / 2, drift_s=drift)
    if injected_skew_s:
        out["injected_skew_s"] = injected_skew_s
    return out


def one_clock(host, instances) -> dict:
    """metadata.json `clocks` where every instance runs on this machine (Mininet)."""
    zero = {"offset_s": 0.0, "uncertainty_s": 0.0, "rtt_s": 0.0, "samples": 0}
    return {"reference": host, "method": "one clock: every instance is a namespace of this "
                                         "machine (offsets 0 by construction)",
            "hosts": {host: {**combine(zero, zero)}},
            "instances": {name: host for name in instances}}


# ---------------------------------------------------------------- the correction (analysis)

def instance_offsets(clocks: dict | None) -> dict:
    """{instance name: offset_s} from metadata.json `clocks` ({} when none is recorded)."""
    if not clocks:
        return {}
    hosts = clocks.get("hosts") or {}
    return {name: float(hosts[h]["offset_s"]) for name, h in
            (clocks.get("instances") or {}).items() if h in hosts}


def event_time(t, fields, offsets: dict) -> float:
    """An events.csv row's time on the reference clock: a row a worker wrote names it
    (`by=<instance>`, workers/control.event_log); the runner's own rows are on it already."""
    return t - offsets.get(fields.get("by"), 0.0)


def warnings(clocks: dict | None) -> list[str]:
    """What a reader of the summary must know about the clocks: an injected skew."""
    hosts = (clocks or {}).get("hosts") or {}
    return [f"host {h}: test-only clock skew of {c['injected_skew_s']:g} s injected "
            f"({SKEW_ENV}); measured offset {c['offset_s']:.6f} s"
            for h, c in hosts.items() if c.get("injected_skew_s")]
