"""Faults on decode instances in virtual time, decided by workers/redispatch.py as in
workers/recovery.Flight.

    faults (SimRecovery) -> decode_faults (this): workers.redispatch -> cluster, engine

A decode instance's fault acts on its continuous batch (`engine.DecodeInstance`):

- **pause** freezes it: no step ends until the resume, and the step in progress then ends
  as late as the pause was long; KV pieces sent to it wait for the resume (a stopped worker
  reads nothing: its receive window fills and the sender blocks); its health checks get no answer. With failover, once a check marks it down every
  request on it is rerouted as Flight's `_on_down` decides (`reroute_decode`): one without a
  token is prefilled again for another decode instance (its stream on the frozen one is
  cancelled), one with tokens fails;
- **kill** loses its batch, its queue and every open stream: each request on it fails or is
  rerouted by the same decision, with the broken stream's reason (UNAVAILABLE), and the
  instance is marked down at once (the emulation's streams fail on the dead worker);
  **restart** brings it back empty at the fault's end, up at the next answered check;
- **slow** multiplies its step time by `factor` from the end of the step in progress.

A request "has tokens" when a step of its own has ended (the emulation's scheduler counts
them a relay later; `FlightView.tokens`).
"""

from __future__ import annotations

from workers import redispatch


class DecodeState:
    """One decode instance's fault state."""

    __slots__ = ("dead", "on", "held")

    def __init__(self):
        self.dead = False
        self.on = set()             # requests whose decode stream is open on it
        self.held = []              # KV pieces for it, due while it was frozen


class DecodeFaults:
    """SimRecovery's decode side (a mixin: `self.c`, `self.loop`, `self.book`,
    `self.by_name`, `self._reroute_decode`)."""

    def _init_decode(self):
        self.dstate = {name: DecodeState() for name in self.c.decode}
        self._breaking = set()      # the streams a kill is breaking (they move themselves)

    def decode_on(self, r):
        """`r`'s decode stream opened on `r.d`: refused at once when that worker is dead."""
        st = self.dstate.get(r.d.name)
        if st is None:
            return
        st.on.add(r)
        if st.dead:
            self.loop.at(self.loop.now(), self._stream_broke, r, r.d, r.attempt)

    def decode_off(self, r, cancel=False):
        """`r` left its decode instance (finished, failed, or moved: `cancel` drops its slot)."""
        st = self.dstate.get(r.d.name)
        if st is not None:
            st.on.discard(r)
        if cancel and r.slot is not None:
            self.c.decode[r.d.name].remove(r.slot)
            r.slot = None

    def decode_frozen(self, r, piece):
        """Hold a KV piece due for a frozen decode instance until its resume (`piece`: the
        arguments of `piece`): a stopped worker reads nothing, so its receive window fills
        and the prefill worker's sender blocks."""
        if r.d is None or r.d.name not in self.dstate or self.c.decode[r.d.name].frozen_at is None:
            return False
        self.dstate[r.d.name].held.append(piece)
        return True

    def _stream_broke(self, r, d, attempt):
        if r.failed or r.d is not d or r.attempt != attempt:
            return
        self.book.set(d, True, "UNAVAILABLE on an RPC")
        self._decode_lost(r, d, "UNAVAILABLE")

    def _decode_lost(self, r, d, reason):
        """`r`'s decode stream on `d` is gone: Flight's `_reroute_decode`."""
        if r.failed or r.d is not d:
            return
        model = self.c.decode[d.name]
        r.tokens = model.tokens(r.slot) if r.slot is not None else 0
        self.decode_off(r, cancel=True)
        self._reroute_decode(r, reason)

    def _decode_down(self, inst, reason):
        """The health book marked decode instance `inst` down (Flight's `_on_down`)."""
        for r in sorted(self.dstate[inst.name].on - self._breaking, key=lambda r: r.id):
            if redispatch.on_instance_down(r, inst, r.replied) == "decode":
                self._decode_lost(r, inst, f"{inst.name} down: {reason}")

    def _decode_answers(self, name):
        if self.dstate[name].dead:
            return False, "UNAVAILABLE"
        return self.c.decode[name].frozen_at is None, "DEADLINE_EXCEEDED"

    # ---- the fault actions on a decode instance ----
    def _decode_pause(self, name, a):
        model = self.c.decode[name]
        if a.phase == "inject":
            if not self.dstate[name].dead:
                model.freeze()
            return
        model.thaw()
        held, self.dstate[name].held = self.dstate[name].held, []
        for piece in held:          # not the ones moved (or failed) while it was frozen
            self.piece(*piece)

    def _decode_kill(self, name, a):
        if a.phase != "inject":
            return
        st, model, inst = self.dstate[name], self.c.decode[name], self.by_name[name]
        st.dead = True
        made = {s.req: n for s, n in model.kill()}
        lost = sorted((r for r in st.on if not r.failed), key=lambda r: r.id)
        self._breaking = set(lost)
        self.book.set(inst, True, "UNAVAILABLE on an RPC")
        self._breaking = set()
        for r in lost:
            r.slot = None               # the worker's batch is gone with it
            r.tokens = made.get(r, 0)
            self.decode_off(r)
            self._reroute_decode(r, "UNAVAILABLE")

    def _decode_restart(self, name, a):
        if a.phase == "inject":
            self._decode_kill(name, a)
        else:
            self.dstate[name].dead = False

    def _decode_slow(self, name, a):
        model = self.c.decode[name]
        model.engine.clock_factor = a.factor if a.phase == "inject" else 1.0
        model.rebound()
