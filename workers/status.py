"""Status: a worker's live state as a tiny file, for the live exporter (testbed/live/).

What a run's files carry after the fact (requests.jsonl, events.csv) says nothing of a worker's
queue while the run goes: how many requests it runs and how many wait, and how full its decode
memory is. With `TESTBED_LIVE_STATUS_S` set (the runner sets it when `--metrics` is on; off, a
worker writes nothing), each prefill, decode and dual-role worker rewrites `status/<name>.json`
in the run directory every that many seconds (wall clock), atomically (a temporary file
renamed), with the fields of its `Health` reply and, for a decode worker, its KV reservation
and capacity in real-world bytes (a dual-role worker: both, and the role in force). One small
write per period per worker; the exporter reads the newest.
"""

import asyncio
import json
import os
import time

from testbed.records import RunDir

STATUS_ENV = "TESTBED_LIVE_STATUS_S"     # set: workers write status/<name>.json this often (s)


def period_s():
    """The status period in seconds, or None when no one watches (the variable unset or 0)."""
    try:
        p = float(os.environ.get(STATUS_ENV, "0"))
    except ValueError:
        return None
    return p if p > 0 else None


def decode_sample(service):
    """A decode worker's state: batched and waiting requests, KV reserved and capacity."""
    engine = service.engine
    cap = getattr(getattr(engine, "model", None), "kv_capacity", None)
    return {"role": "decode", "running": len(service.batch), "waiting": len(service.waiting),
            "kv_reserved_real_bytes": float(getattr(engine, "reserved", 0.0)),
            "kv_capacity_real_bytes": None if cap is None else float(cap)}


def prefill_sample(service):
    """A prefill worker's state: the request it prefills (0 or 1) and those waiting."""
    return {"role": "prefill", "running": int(service.active), "waiting": int(service.waiting)}


def dualrole_sample(service):
    """A dual-role worker's state (workers/dualrole.py): the role in force (`prefill`,
    `decode` or `converting`), both roles' running and waiting requests summed (what its
    Health reply counts) and apart, and its decode memory as a decode worker's."""
    pre, dec = prefill_sample(service.pre), decode_sample(service.dec)
    return {**dec, "role": service.role, "roles": ["prefill", "decode"],
            "running": pre["running"] + dec["running"], "waiting": pre["waiting"] + dec["waiting"],
            "prefill": {k: pre[k] for k in ("running", "waiting")},
            "decode": {k: dec[k] for k in ("running", "waiting")}}


def start(rt, name, sample):
    """The writer task of `status/<name>.json` (`sample()`: the fields), or None when off."""
    period = period_s()
    if period is None:
        return None
    return asyncio.get_running_loop().create_task(_write_loop(RunDir(rt.dir), name, sample,
                                                              period))


async def _write_loop(rd, name, sample, period):
    rd.status.mkdir(exist_ok=True)
    path = rd.status_file(name)
    tmp = path.with_name(f".{path.name}.tmp")
    while True:
        tmp.write_text(json.dumps({"time": time.time(), **sample()}))
        tmp.rename(path)
        await asyncio.sleep(period)
