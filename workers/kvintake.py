"""KV intake of a decode worker: the frames its KV socket receives, gathered per request.

Place in the architecture: `workers.kvwire.serve` hands every frame to `KvIntake.on_frame`;
the decode service (`workers.decode.DecodeService`) waits on a request's `Slot.kv_done`, then
batches the request. A slot is made by whichever comes first, the request's first frame or its
`Decode` call.

Exactly-once admission: a re-dispatched request's KV may come from several prefill attempts
(at-least-once prefill). The slot follows the newest attempt until its KV is complete; frames of
any other attempt, or for a request already served, are discarded and counted (`kv_discarded`
rows in events.csv; complete ones are duplicates). Within a transfer the frames' sequence numbers
must follow each other: a frame that comes twice is discarded and counted (`duplicate_frames`),
a gap fails the transfer with the missing frame's number, and frame 0 again (the sender's
retry on a new connection) starts the transfer over. KV of a request whose `Decode` call never
comes is freed after the KV deadline (`reap_orphans`). A `Decode` call that ends at its KV
deadline leaves what arrived so far in an unclaimed slot (`keep`): the scheduler may open the
call again while the prefill goes on (workers/redispatch.py, `after_kv_timeout`), and the
transfer continues into it; if no call comes, it is freed as an orphan.
"""

import asyncio
import collections
import time

from workers import control, kvwire

SERVED_KEPT = 100_000       # request ids remembered as served (their late frames are discarded)


class Slot:
    """One request's state on this worker: KV arrival, then tokens."""

    def __init__(self, rid):
        self.rid = rid
        self.created = time.monotonic()
        self.kv_done = asyncio.Event()
        self.kv_error = ""
        self.kv_bytes = 0
        self.kv_first = 0.0
        self.kv_last = 0.0
        self.claimed = False
        self.output_len = 0
        self.times = []
        self.token_ids = []
        self.emitted = 0
        self.join = 0.0
        self.held = 0.0             # when admission was first refused for capacity (0: never)
        self.first_step_s = 0.0     # the modelled length of the step that made its first token
        self.input_len = 0
        self.kv_need = 0.0          # real-world bytes it holds in decode memory once batched
        self.reserved = 0.0
        self.wake = asyncio.Event()
        self.finished = False
        self.attempt = -1            # the prefill attempt whose KV this slot takes
        self.next_seq = 0            # the frame the transfer expects next (kvwire seq)
        self.client = ""             # Request.client: whose token stream takes the tokens
        self.marked = False          # the scheduler was told the first token went direct
        self.cache_bytes = 0
        self.cache_tokens = 0
        self.kv_late = False         # the Decode call ended at its KV deadline

    KV_STATE = ("kv_done", "kv_error", "kv_bytes", "kv_first", "kv_last", "attempt", "next_seq")


class KvIntake:
    """The slots of the requests whose KV is arriving or has arrived, by request id."""

    def __init__(self, name, engine, assembling, orphan_s, log):
        """`assembling`: the engine rebuilds the state from the frames (`receive`, `release`)."""
        self.name, self.engine, self.assembling, self.log = name, engine, assembling, log
        self.orphan_s = orphan_s
        self.slots = {}
        self.served = collections.OrderedDict()     # request id -> admitted attempt
        self.discarded = {}                         # (rid, attempt) -> bytes, last time, complete
        self.duplicates = 0
        self.duplicate_frames = 0                   # frames of a transfer that came twice
        self.events = None

    def claim(self, rid):
        """`rid`'s `Decode` call has come (again, if it was re-routed back here: this call
        serves it again): its slot, made if no frame came yet."""
        self.served.pop(rid, None)
        slot = self.slots.get(rid)
        if slot is None:
            slot = self.slots[rid] = Slot(rid)
        slot.claimed = True
        return slot

    def on_frame(self, wire, seq, flags, payload, t_first, t_last):
        rid, attempt = control.split_id(wire)
        slot = self.slots.get(rid)
        if rid in self.served or (slot is not None and (
                attempt < slot.attempt or slot.kv_done.is_set())):   # complete: all else late
            self._discard(rid, attempt, flags, len(payload))
            return
        if slot is None:
            slot = self.slots[rid] = Slot(rid)
        abort = flags & kvwire.FLAG_ABORT
        if attempt > slot.attempt or (seq == 0 and slot.next_seq and not abort):
            # a newer attempt, or the same one sent again from its start on a new connection
            # (the sender's retry, workers/prefill.py), supersedes a partial transfer
            self._restart(slot, attempt)
        elif seq != slot.next_seq and not abort:
            if seq < slot.next_seq:     # a frame that came twice
                self.duplicate_frames += 1
                self._discard(rid, attempt, 0, len(payload))
                return
            slot.kv_error = f"KV frame {slot.next_seq} of request {rid} missing (got {seq})"
            slot.kv_done.set()
            return
        slot.next_seq = seq + 1
        if not slot.kv_first:
            slot.kv_first = t_first
        slot.kv_bytes += len(payload)
        slot.kv_last = t_last
        if self.assembling:
            self.engine.receive(rid, seq, flags, payload)
        if flags & kvwire.FLAG_ABORT:
            slot.kv_error = "KV transfer aborted by the sender"
            slot.kv_done.set()
        elif flags & kvwire.FLAG_LAST:
            slot.kv_done.set()

    def _restart(self, slot, attempt):
        if slot.kv_bytes:
            self._discard(slot.rid, slot.attempt, 0, slot.kv_bytes)
            slot.kv_bytes, slot.kv_first = 0, 0.0
            if self.assembling:
                self.engine.release(slot.rid)
        slot.attempt, slot.next_seq = attempt, 0

    def keep(self, rid, slot):
        """`rid`'s `Decode` call ended at its KV deadline: the KV that arrived stays in a new,
        unclaimed slot for the scheduler's next call (freed by `reap_orphans` if none comes)."""
        if self.slots.get(rid) is not slot:
            return
        kept = self.slots[rid] = Slot(rid)
        for k in Slot.KV_STATE:
            setattr(kept, k, getattr(slot, k))

    def on_kv_error(self, err):
        self.log.warning("KV connection error: %s", err)

    def done(self, rid, slot):
        """`rid`'s `Decode` call has ended: its slot goes, later frames for it are discarded."""
        if self.slots.get(rid) is slot:
            self.slots.pop(rid, None)
        self.served[rid] = slot.attempt
        while len(self.served) > SERVED_KEPT:
            self.served.popitem(last=False)

    def _discard(self, rid, attempt, flags, nbytes):
        e = self.discarded.setdefault((rid, attempt), {"bytes": 0, "complete": False})
        e["bytes"] += nbytes
        e["t"] = time.monotonic()
        if flags & kvwire.FLAG_LAST:
            e["complete"] = True
            self.flush_discarded(0.0)

    def flush_discarded(self, idle_s=1.0):
        """Log discarded KV (per request and attempt) that has seen no frame for `idle_s`."""
        now = time.monotonic()
        for key, e in list(self.discarded.items()):
            if now - e["t"] >= idle_s or e["complete"]:
                del self.discarded[key]
                self.duplicates += e["complete"]
                if self.events is not None:
                    self.events("kv_discarded", instance=self.name, id=key[0], attempt=key[1],
                                bytes=e["bytes"], complete=int(e["complete"]))

    async def discard_loop(self):
        while True:
            await asyncio.sleep(1.0)
            self.flush_discarded()

    def reap_orphans(self):
        """KV that arrived for a request whose Decode stream never came is freed after a while."""
        now = time.monotonic()
        for rid, slot in list(self.slots.items()):
            if not slot.claimed and now - slot.created > self.orphan_s:
                self.log.warning("dropping KV of unclaimed request %d", rid)
                self.slots.pop(rid, None)
                self.engine.release(rid)
