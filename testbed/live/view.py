"""The live terminal view of `testbed run`: one line per variant, redrawn while it runs (rich).

Each line says, for its variant: requests done / failed / in flight of the total, TTFT p50 and
p90 so far (real-world), WAN egress against the link rate in force (real-world Gbit/s), the
threshold in force and the prefill/decode roles, the instances down and the faults injected now.
It reads the run directory as the exporter does (`testbed.live.state.RunState`), from the
orchestrator's drive loop (`track(...).poll()`, at most `REFRESH_HZ` times a second), and draws
on standard error. A variant that ended stays as a plain line above the one running.

`choose(no_progress)` picks the view: the rich board on a terminal, today's tqdm bar under CI
(`CI` set to true, as CI services do) or when standard error is not a terminal (the bar then
stays off, as before), nothing with `--no-progress`; `tracker(...)` is what the drive loop polls.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from rich.console import Console
from rich.live import Live
from rich.text import Text

from testbed.live.state import RunState
from testbed.progress import Progress

REFRESH_HZ = 4.0


def choose(no_progress, stream=None):
    """The progress a run shows: a `Board`, True (the tqdm bar) or False (none)."""
    stream = stream or sys.stderr
    if no_progress or not stream.isatty():
        return False
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return True
    return Board(Console(file=stream))


def tracker(choice, run_dir, records, total, label):
    """One variant's progress for the drive loop (poll, write, close): its line of the board
    when `choice` is a `Board`, else the tqdm bar (`choice`: shown or not)."""
    if isinstance(choice, Board):
        return choice.track(run_dir, total)
    return Progress(records, total, label, choice)


def _ms(s):
    return "-" if s is None else f"{s * 1e3:,.0f}"


def line(run, total) -> str:
    """One variant's line, from its `RunState`."""
    if not run.started:
        return f"{run.dir.path.name}: starting"
    t = list(run.ttfts)
    p50, p90 = (np.percentile(t, [50, 90]) if t else (None, None))
    kv = run.link["kv"]
    roles = run.role_counts()
    role_s = " ".join(f"{dc[0].upper()}{role[0]}{n}" for (role, dc), n in sorted(roles.items()))
    down = ",".join(sorted(run.down)) or "all up"
    faults = ",".join(f"{f.kind}:{f.target}" for f in run.faults.values() if f.active) or "none"
    threshold = "-" if run.threshold is None else f"{run.threshold:,}"
    return (f"{run.variant:>12} done {run.completed}/{total} failed {run.failed} "
            f"in flight {run.in_flight} | TTFT p50 {_ms(p50)} p90 {_ms(p90)} ms | egress "
            f"{kv.egress_gbps:.2f}/{kv.link_gbps:.0f} Gb/s | t {threshold} {role_s} | "
            f"{down} | faults {faults}")


class Board:
    """The variants of one `testbed run`, one line each."""

    def __init__(self, console):
        self.console = console

    def track(self, run_dir, total):
        return Tracker(self, run_dir, total)


class Tracker:
    """One variant while it runs: the Progress interface of testbed/run.py (poll, write,
    close)."""

    def __init__(self, board, run_dir, total):
        self.board, self.total = board, total
        self.run = RunState(run_dir)
        self.last = 0.0
        # Redrawn from poll() only: no refresh thread beside the 20 Hz counter sampler's
        self.live = Live(Text(""), console=board.console, auto_refresh=False, transient=True)
        self.live.start()

    def poll(self):
        now = time.monotonic()
        if now - self.last < 1.0 / REFRESH_HZ:
            return
        self.last = now
        self.run.poll()
        self.live.update(Text(line(self.run, self.total)), refresh=True)

    def write(self, msg):
        self.board.console.print(msg, markup=False, highlight=False)

    def close(self):
        self.last = 0.0
        self.poll()
        self.live.stop()
        self.board.console.print(line(self.run, self.total), markup=False, highlight=False)
