"""Rate traces: a bandwidth trace CSV (`network.wan.rate_trace`), read and checked.

Place in the architecture: the network's description floor (beside `testbed.net.spec`). Read
twice by design: `testbed.config` checks every row before anything starts, and `testbed.deploy`
turns the rows into scheduled link changes (`rate_trace_rows`).
"""

from testbed import units, yamlload
from testbed.errors import ConfigError
from testbed.units import MAX_DURATION_S

MAX_RATE_TRACE_BYTES = 1 << 20      # 1 MiB of time,rate rows
MIN_LOOP_PERIOD_S = 1.0              # a looped rate trace repeats at most once a second
MAX_LINK_CHANGES = 100_000           # scheduled changes + trace rows (after looping)


def read_rate_trace(path):
    """Rows (t_s, rate_bps), real-world, of a bandwidth trace CSV: `time,rate` per line with units
    ('60s,20Gbit'); '#' comments and one header line allowed; times must not decrease, rates
    must be above 0 (a link that is down is `up: false` in network.wan.changes)."""
    text = yamlload.read_text(path, "a rate trace (CSV of time,rate)", MAX_RATE_TRACE_BYTES,
                              key="network.wan.rate_trace.path")
    rows, header_seen = [], False
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            if len(cells) != 2:
                raise ValueError(f"expected 2 columns, got {len(cells)}")
            t, r = units.duration_s(cells[0]), units.rate_bps(cells[1])
        except ValueError as e:
            if not rows and not header_seen:
                header_seen = True       # the header line
                continue
            raise ConfigError(f"line {n}: expected time,rate ({e})", path=str(path)) from None
        if rows and t < rows[-1][0]:
            raise ConfigError(f"line {n}: time goes backwards", path=str(path))
        if t > MAX_DURATION_S:
            raise ConfigError(f"line {n}: time {cells[0]} is beyond 7 days (a hard limit)",
                              path=str(path))
        if r <= 0:
            raise ConfigError(f"line {n}: rate {cells[1]} is not above 0; a link that is down "
                              f"is network.wan.changes: [{{at: ..., up: false}}]", path=str(path))
        rows.append((t, r))
    if not rows:
        raise ConfigError("no time,rate rows", path=str(path))
    return rows
