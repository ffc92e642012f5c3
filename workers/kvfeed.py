"""The scheduler's KV-event feed: its subscriber process, the view it feeds, what it measured.

`model.engine: vllm` (docs/vllm.md, "KV events"). The scheduler owns one subscriber process
(workers/kvsub.py, the vLLM venv's Python, started here as the scheduler's child in its own
Mininet host) that subscribes to every vLLM instance's KV-event publisher over the emulated
network and writes the batches, in order, to a pipe. `KvEventFeed` reads that pipe, decodes each
batch (workers/kvevents.py) and applies it to the `workers.kvview.CacheView` that placement
reads (workers/kvplace.py).

What it records: one kv_events.csv row per batch (the engine's publish time, the subscriber's
receive time, the time the view had it, payload bytes, events by kind, replayed or not), an
events.csv row per gap, replay, resync and restarted publisher, and at the end kv_events.json:
the totals, the delay from the engine's publish to the view (p50, p90, max) and what each
instance's events did to the view. The runner puts kv_events.json into metadata.json
(`cache_view`).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import time

from testbed import lifecycle, vllmenv
from workers import kvevents
from workers.kvview import CacheView

ROW = ("applied", "inst", "seq", "ts", "recv", "bytes", "stored", "removed", "cleared",
       "replayed")
SOURCE = "vllm_kv_events"


def endpoints(rt):
    """[(instance, publisher endpoint, replay endpoint)] of every vLLM instance of the run."""
    v = rt.vllm
    return [(i.name, f"tcp://{i.ip}:{v.kv_events_port}", f"tcp://{i.ip}:{v.kv_replay_port}")
            for i in rt.of_role("prefill", "decode")]


def argv(python, eps):
    return [python, "-m", "workers.kvsub", *(f"{n}={e},{r}" for n, e, r in eps)]


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class KvEventFeed:
    """Start the subscriber, apply what it forwards to `view`, keep the measurements."""

    def __init__(self, eps, python, view=None, rows_path=None, events=None, log=None):
        self.eps, self.python = list(eps), python
        self.view = view if view is not None else CacheView(n for n, _, _ in self.eps)
        self.events = events or (lambda kind, **f: None)
        self.log = log
        self.rows = None
        if rows_path is not None:
            self._rows_file = open(rows_path, "w", newline="")
            self.rows = csv.writer(self._rows_file)
            self.rows.writerow(ROW)
        self.proc = self.task = None
        self.changed = asyncio.Condition()
        self.delays, self.bytes, self.batches = [], 0, 0
        self.kinds = {"stored": 0, "removed": 0, "cleared": 0}
        self.notes = {"gap": 0, "replay": 0, "replayed_batches": 0, "resync": 0,
                      "restarted": 0, "undecodable": 0}
        self.up_at = None

    async def start(self, cmd=None):
        """Start the subscriber (`cmd`: another command writing the same records)."""
        env = dict(os.environ, PYTHONPATH=str(vllmenv.REPO))
        env.pop("VIRTUAL_ENV", None)
        self.proc = await asyncio.create_subprocess_exec(
            *(cmd or argv(self.python, self.eps)), stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, env=env, preexec_fn=lifecycle.die_with_parent())
        self.task = asyncio.create_task(self._read())

    async def _read(self):
        out = self.proc.stdout
        try:
            while True:
                head_n, pay_n = kvevents.frame_lengths(
                    await out.readexactly(kvevents.FRAME_PREFIX))
                header = json.loads(await out.readexactly(head_n))
                payload = await out.readexactly(pay_n) if pay_n else b""
                self.handle(header, payload)
                async with self.changed:
                    self.changed.notify_all()
        except asyncio.IncompleteReadError:
            if self.log is not None:
                self.log.warning("KV-event subscriber ended (exit %s)", self.proc.returncode)

    def handle(self, header, payload, now=None):
        """Apply one record of the subscriber's stream (a batch, or a note about the sequence)."""
        kind, inst = header["kind"], header.get("inst", "")
        if kind == "batch":
            self._batch(header, payload, time.time() if now is None else now)
        elif kind in ("resync", "restarted"):
            self.notes[kind] += 1
            self.view.resync(inst)
            self.events(f"kv_events_{kind}", instance=inst,
                        **{k: v for k, v in header.items() if k not in ("kind", "inst")})
        elif kind in ("gap", "replay"):
            self.notes[kind] += 1
            self.notes["replayed_batches"] += header.get("batches", 0)
            self.events(f"kv_events_{kind}", instance=inst,
                        **{k: v for k, v in header.items() if k not in ("kind", "inst")})
        elif kind == "up":
            self.up_at = time.time() if now is None else now

    def _batch(self, header, payload, now):
        inst = header["inst"]
        try:
            batch = kvevents.decode_batch(payload)
        except kvevents.DecodeError as e:
            self.notes["undecodable"] += 1
            self.view.resync(inst)      # what it held may be stale now
            self.events("kv_events_undecodable", instance=inst, seq=header["seq"], error=str(e))
            return
        stored, removed, cleared = self.view.apply(inst, batch)
        self.batches += 1
        self.bytes += len(payload)
        for k, n in (("stored", stored), ("removed", removed), ("cleared", cleared)):
            self.kinds[k] += n
        if not header.get("replayed"):      # a replayed batch's delay is the replay's
            self.delays.append(now - batch.ts)
        if self.rows is not None:
            self.rows.writerow((f"{now:.6f}", inst, header["seq"], f"{batch.ts:.6f}",
                                f"{header['recv']:.6f}", len(payload), stored, removed,
                                cleared, int(bool(header.get("replayed")))))

    async def wait_until(self, predicate, timeout_s):
        """Wait (bounded) until `predicate()` holds after a batch; whether it did."""
        async def until():
            async with self.changed:
                await self.changed.wait_for(predicate)
        try:
            await asyncio.wait_for(until(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_up(self, timeout_s):
        """Wait (bounded) until the subscriber is connected and caught up (its `up` record)."""
        return await self.wait_until(lambda: self.up_at is not None, timeout_s)

    def summary(self, requests=None):
        """kv_events.json: the source of the view, the totals and the delays (seconds)."""
        d = self.delays
        per = {n: {**vars(v.counts), "blocks_held": len(v.by_hash), "block_size": v.block_size}
               for n, v in self.view.instances.items()}
        out = {"source": SOURCE, "endpoints": {n: [e, r] for n, e, r in self.eps},
               "batches": self.batches, "events": dict(self.kinds), "payload_bytes": self.bytes,
               **self.notes, "delay_s": {"p50": _quantile(d, 0.5), "p90": _quantile(d, 0.9),
                                         "max": max(d) if d else None, "n": len(d)},
               "instances": per}
        if requests:
            out["requests_placed"] = requests
            out["stored_events_per_request"] = self.kinds["stored"] / requests
            out["payload_bytes_per_request"] = self.bytes / requests
        return out

    async def close(self, summary_path=None, requests=None):
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
            if self.proc.returncode is None:
                self.proc.kill()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.rows is not None:
            self._rows_file.close()
        if summary_path is not None:
            tmp = summary_path.with_name(f".{summary_path.name}")
            tmp.write_text(json.dumps(self.summary(requests), indent=1))
            tmp.replace(summary_path)
