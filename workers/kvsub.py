"""The scheduler's KV-event subscriber: zmq SUB to every vLLM instance, in order, to stdout.

Run by the vLLM venv's Python (it has pyzmq; the testbed's venv does not), as the scheduler's
child in the scheduler's Mininet host (`workers.kvfeed.KvEventFeed` starts it), so every batch
crosses the emulated network from the instance's host to the scheduler's: a PrfaaS instance's
through the WAN router (its KV direction), a local one's over the local bridge.

    python -m workers.kvsub NAME=tcp://IP:PORT,tcp://IP:REPLAY_PORT ...

For each instance it subscribes to the publisher's endpoint and checks each batch's sequence
number (`workers.kvevents.Sequencer`). A gap (joined late, or messages dropped) is filled by a
replay request to the instance's replay endpoint (vLLM's ROUTER: the first missing sequence
number as 8 bytes, answered with every buffered batch from there and an end marker, seq -1).
What the replay cannot cover (the publisher's buffer has moved on, or no answer within
REPLAY_TIMEOUT_S) is reported as `resync`: the scheduler drops that instance's view. zmq drops
what a PUB socket sends before a subscription reaches it, and a lost batch shows as a gap only
when another follows; so the subscriber also catches up (a replay from the next number) once
at the start, before it reports `up`, and once whenever a publisher has been quiet for QUIET_S
after a batch.

It writes records (`workers.kvevents.frame`) to stdout: `batch` (instance, seq, receive time,
whether replayed, the raw payload), `gap`, `resync`, `restarted` (sequence 0 again: a new
server, whose cache is empty), `replay` (how many batches a replay brought).
"""

import argparse
import sys
import time

from workers.kvevents import DUPLICATE, GAP, RESTARTED, Sequencer, frame, seq_of

REPLAY_TIMEOUT_S = 2.0
QUIET_S = 1.0
POLL_MS = 200


class Publisher:
    """One instance's SUB socket, replay endpoint and sequence state."""

    def __init__(self, zmq, ctx, name, endpoint, replay):
        self.zmq, self.ctx, self.name, self.replay_ep = zmq, ctx, name, replay
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.seq = Sequencer()
        self.last_s, self.quiet_checked = time.monotonic(), False   # the last live batch

    def replay(self, start):
        """[(seq, payload)] the publisher still buffers from `start`, or None (no answer)."""
        zmq = self.zmq
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(self.replay_ep)
            s.send_multipart([b"", start.to_bytes(8, "big")])
            out, deadline = [], time.monotonic() + REPLAY_TIMEOUT_S
            while time.monotonic() < deadline:
                if not s.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                    break
                _, _topic, seqb, payload = s.recv_multipart()
                seq = seq_of(seqb)
                if seq < 0:
                    return out
                out.append((seq, payload))
            return None
        finally:
            s.close()


class Subscriber:
    def __init__(self, out):
        self.out = out

    def emit(self, header, payload=b""):
        self.out.write(frame(header, payload))
        self.out.flush()

    def deliver(self, pub, seq, payload, replayed=False):
        """Forward one batch in order, a gap filled (or resynced) first; duplicates dropped."""
        kind = pub.seq.classify(seq)
        if kind == DUPLICATE:
            return
        if kind == RESTARTED:
            self.emit({"kind": "restarted", "inst": pub.name, "seq": seq})
            pub.seq.restart()
        elif kind == GAP and replayed:      # the buffer no longer holds what is missing
            self._resync(pub, seq, "replay buffer starts later")
        elif kind == GAP:
            self._fill(pub, seq)
            if pub.seq.classify(seq) == DUPLICATE:      # the replay brought it
                return
        self.emit({"kind": "batch", "inst": pub.name, "seq": seq, "recv": time.time(),
                   "replayed": replayed}, payload)
        pub.seq.applied(seq)

    def _fill(self, pub, seq):
        missing = pub.seq.next
        self.emit({"kind": "gap", "inst": pub.name, "expected": missing, "got": seq})
        got = pub.replay(missing)
        if got is None:
            self._resync(pub, seq, "no replay answer")
            return
        self.emit({"kind": "replay", "inst": pub.name, "from": missing, "batches": len(got)})
        for s, payload in got:
            self.deliver(pub, s, payload, replayed=True)
        if pub.seq.next < seq:              # the buffer ended before the live batch
            self._resync(pub, seq, "replay ended early")

    def catch_up(self, pub):
        """Ask for what the publisher buffered past the last batch delivered: a batch published
        before this SUB socket's subscription reached the publisher (zmq drops it), or the last
        of a burst lost with nothing after it to show the gap. No answer: nothing known lost."""
        got = pub.replay(pub.seq.next)
        if got:
            self.emit({"kind": "replay", "inst": pub.name, "from": pub.seq.next,
                       "batches": len(got)})
            for s, payload in got:
                self.deliver(pub, s, payload, replayed=True)
        pub.quiet_checked = True

    def _resync(self, pub, seq, why):
        self.emit({"kind": "resync", "inst": pub.name, "lost_from": pub.seq.next,
                   "lost_to": seq - 1, "why": why})
        pub.seq.next = seq


def run(pubs, sub, poller):
    """Deliver live batches; a publisher quiet for QUIET_S since its last one is caught up once
    (`Subscriber.catch_up`), so a lost last batch shows within about QUIET_S."""
    by_sock = {p.sub: p for p in pubs}
    while True:
        for sock, _ in poller.poll(POLL_MS):
            _topic, seqb, payload = sock.recv_multipart()
            pub = by_sock[sock]
            sub.deliver(pub, seq_of(seqb), payload)
            pub.last_s, pub.quiet_checked = time.monotonic(), False
        for pub in pubs:
            if not pub.quiet_checked and time.monotonic() - pub.last_s > QUIET_S:
                sub.catch_up(pub)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("endpoints", nargs="+", help="NAME=tcp://IP:PORT,tcp://IP:REPLAY_PORT")
    args = p.parse_args(argv)
    import zmq  # reason: the vLLM venv's pyzmq; the testbed's venv has none
    ctx = zmq.Context.instance()
    pubs = []
    for spec in args.endpoints:
        name, eps = spec.split("=", 1)
        pubs.append(Publisher(zmq, ctx, name, *eps.split(",")))
    poller = zmq.Poller()
    for pub in pubs:
        poller.register(pub.sub, zmq.POLLIN)
    sub = Subscriber(sys.stdout.buffer)
    for pub in pubs:        # connected, and caught up with what was published before
        sub.catch_up(pub)
    sub.emit({"kind": "up", "instances": [pub.name for pub in pubs]})
    try:
        run(pubs, sub, poller)
    except (KeyboardInterrupt, BrokenPipeError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
