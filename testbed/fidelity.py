"""Fidelity guards: does what a run measured stay within what the emulated link allows?

Place in the architecture: the measuring side (`measure.CounterSampler`, `run.Run`) calls
`exceeds_link` on each counter sample and `host_tcp_counters` before and after the requests;
analysis (`testbed.analysis.analyse`) calls `flag_artifacts` on the timeseries and `guards` for the
summary; `plot` leaves flagged samples out. Three guards, each a summary key and, when it fires,
a warning in real-world units:

- `kv_transfers`: every KV transfer over the WAN against a fluid model of the link: its bytes
  (on the wire: 1514-byte frames carry 1448 payload bytes) served at the link rate in force
  (timeseries `kv_link_gbps`, 0 while down) behind every transfer that had started before this
  one ended (under any work-conserving sharing those may go first), and never before the sender
  handed over its last byte; plus one RTT (the configured one, or the link probe's median at
  rest when larger: `path_allowance`) and three jitter deviations. A transfer that took more
  than `INFLATION_TOL` beyond that is inflated: the emulation (CPU, TCP timers, the delay line)
  added time the modelled link would not.
- `tcp`: TCP retransmission timeouts, tail-loss probes and retransmitted segments counted by the
  kernel of every end host (`/proc/<pid>/net/netstat`, `/proc/<pid>/net/snmp`: the files of the
  host's network namespace) over the request phase.
- `startup`: warnings the workers logged before the requests started (`logs/*.log`), e.g. a
  prefill worker that could not open its KV connections in time because many instances were
  starting on few cores: its first requests then pay handshakes the modelled system would not.
- `rate_artifacts`: counter samples whose rate exceeds the link rate by more than the sampling
  can explain (the counter read's own duration, the HTB burst and one GSO packet). They are
  flagged in `<dir>_artifact` columns, and left out of egress statistics and plots.
"""

import datetime
import math
import pathlib
import re
import subprocess

import numpy as np
import pandas as pd

from testbed.net.linkmodel import BURST_S, DIRECTIONS   # the shaper's HTB burst
from testbed.net.ns import ns_run
from testbed.net.probe import deviation_warning
WIRE_PER_PAYLOAD = 1514 / 1448     # Ethernet frame bytes per TCP payload byte at full MTU
INFLATION_TOL = 0.25               # a transfer is inflated beyond 1.25x what the link allows
RATE_TOL = 0.02                    # counter rounding, HZ-granular HTB token refills
GSO_BYTES = 65536                  # one TSO/GSO packet may pass on HTB credit
TCP_COUNTERS = {"TcpExt": ("TCPTimeouts", "TCPLossProbes"), "Tcp": ("RetransSegs",)}


def lower_scale_hint(factor):
    """What a guard's warning at scale.time `factor` tells the user to do: which scale would
    be faithful, as far as one run knows (lower than this one)."""
    if factor <= 1:
        return "at real speed the processes wait for CPU: fewer instances per machine"
    return (f"a faithful scale.time is lower than {factor:g} on this machine now "
            "(`scale.time: auto` finds it)")


# ---------------------------------------------------------------- rate artifacts

def exceeds_link(rate_bps, link_bps, dt_s, read_s=0.0):
    """Whether a counter sample's rate is more than the link could have carried (emulated bit/s
    and seconds; numbers or numpy arrays). Allowed: the link rate over the interval stretched by
    the counter read's duration `read_s` (the sample's time is taken before the read), plus
    RATE_TOL, plus one HTB burst and one GSO packet over the interval."""
    dt = np.maximum(dt_s, 1e-9)
    allowed = (link_bps * (dt + read_s) / dt * (1 + RATE_TOL)
               + 8 * (link_bps / 8 * BURST_S + GSO_BYTES) / dt)
    return (np.asarray(rate_bps) > allowed) & (np.asarray(link_bps) > 0)


def flag_artifacts(ts, scale):
    """`ts` (`scale`: the run's testbed.scale.Scale) with `<dir>_artifact` columns (0/1), computed from the rates when the sampler did not
    write them (older runs). The link rate of an interval is the larger of its two ends' (a rate
    change between samples)."""
    if ts is None or not len(ts):
        return ts
    ts = ts.copy()
    dt = ts.time.diff().fillna(0).to_numpy()
    read = ts.read_s.to_numpy() if "read_s" in ts else 0.0
    for d in DIRECTIONS:
        col = f"{d}_artifact"
        if col in ts or f"{d}_link_gbps" not in ts:
            continue
        link = scale.emulated_rate(ts[f"{d}_link_gbps"].to_numpy() * 1e9)
        link = np.maximum(link, np.concatenate([link[:1], link[:-1]]))
        flag = exceeds_link(ts[f"{d}_rate_bps"].to_numpy(), link, dt, read) & (dt > 0)
        ts[col] = flag.astype(int)
    return ts


def artifact_mask(ts, direction="kv"):
    """Boolean Series: the rows flagged as artifacts in `direction` (none when not flagged)."""
    col = f"{direction}_artifact"
    if ts is None or col not in ts:
        return pd.Series(False, index=getattr(ts, "index", None), dtype=bool)
    return ts[col].fillna(0).astype(int) == 1


def without_artifacts(ts):
    """The timeseries without the rows flagged in either direction (egress statistics)."""
    if ts is None:
        return ts
    bad = artifact_mask(ts, "kv") | artifact_mask(ts, "request")
    return ts[~bad].reset_index(drop=True)


def rate_artifacts(ts):
    """{'kv': n, 'request': n, 'samples': N} flagged samples."""
    out = {d: int(artifact_mask(ts, d).sum()) for d in DIRECTIONS} if ts is not None else {}
    out["samples"] = int(len(ts)) if ts is not None else 0
    return out


# ---------------------------------------------------------------- KV transfers vs the link model

class FluidLink:
    """A link serving bits at a piecewise-constant rate (emulated bit/s from time t[k] on)."""

    def __init__(self, t, rate_bps):
        self.t = np.asarray(t, dtype=float)
        self.rate = np.asarray(rate_bps, dtype=float)
        self.cum = np.concatenate([[0.0], np.cumsum(self.rate[:-1] * np.diff(self.t))])

    def capacity(self, t0):
        """Bits the link could carry from t[0] to t0 (negative before t[0])."""
        k = int(np.searchsorted(self.t, t0, side="right")) - 1
        k = max(k, 0)
        return self.cum[k] + (t0 - self.t[k]) * self.rate[k]

    def served_at(self, t0, bits):
        """When `bits` starting at t0 have crossed (inf when the link stays down)."""
        target = self.capacity(t0) + bits
        i = int(np.searchsorted(self.cum, target, side="left"))
        if i == 0:
            return t0 + bits / self.rate[0] if self.rate[0] > 0 else math.inf
        if i == len(self.cum):
            r = self.rate[-1]
            return self.t[-1] + (target - self.cum[-1]) / r if r > 0 else math.inf
        return self.t[i - 1] + (target - self.cum[i - 1]) / self.rate[i - 1]


def link_model(run, ts, links):
    """The KV direction's FluidLink: the timeseries' rate in force (0 while down), or the
    built rate when there is no timeseries. `run`: testbed.rundir.RunInfo; `links`: direction
    -> the emulated `Link` the shaper ran (deployment.json)."""
    if ts is None or not len(ts) or "kv_link_gbps" not in ts:
        return FluidLink([0.0], [links["kv"].rate_bps])
    up = ts.kv_up.to_numpy() if "kv_up" in ts else 1
    return FluidLink(ts.time.to_numpy(), _kv_link_bps(run, ts) * up)


def _kv_link_bps(run, ts):
    """The kv link's rate in each sample of `ts` (emulated bit/s)."""
    return (ts.kv_link_bps.to_numpy() if "kv_link_bps" in ts     # emulated, as sampled
            else run.scale.emulated_rate(ts.kv_link_gbps.to_numpy() * 1e9))   # older runs


def _remote_transfers(df):
    """The remote KV transfers of the requests table with their times, by first byte."""
    cols = ["send_start", "send_end", "kv_recv_end", "kv_bytes"]
    if not {"id", "route", *cols} <= set(df.columns):
        return df.iloc[:0]
    return df[(df.route == "remote")].dropna(subset=cols).sort_values("send_start")


def _fifo(t, link):
    """Per transfer of `t` (`_remote_transfers`): when `link` (a FluidLink), serving every
    transfer's bytes from its first byte on in the order they started, would have carried it."""
    start, bits = t.send_start.to_numpy(), t.kv_bytes.to_numpy() * 8 * WIRE_PER_PAYLOAD
    fifo, free = np.empty(len(t)), -math.inf
    for i in range(len(t)):               # all transfers one queue, in the order they started
        free = link.served_at(max(free, start[i]), bits[i])
        fifo[i] = free
    return fifo


def _busy_until(t, link):
    """Per transfer of `t`: when `link` would have carried its bytes behind every transfer
    that started before it ended."""
    fifo = _fifo(t, link)
    # everything that started before this transfer ended may have been served ahead of it
    ahead = np.searchsorted(t.send_start.to_numpy(), t.kv_recv_end.to_numpy(), side="left") - 1
    return fifo[np.maximum(ahead, np.arange(len(t)))]


def _link_bound(t, link):
    """Per transfer of `t`: whether `link` could have held it past its sender's last byte. The
    link serves each transfer's bytes from its first byte on (sooner than the sender handed them
    over), in any work-conserving order; a transfer is served by the end of the busy period it
    falls in, so it is bound where that end is after its sender's last byte."""
    if not len(t):
        return np.zeros(0, dtype=bool)
    fifo, start = _fifo(t, link), t.send_start.to_numpy()
    period = np.cumsum(np.r_[True, start[1:] >= fifo[:-1]])
    end = pd.Series(fifo).groupby(period).transform("max").to_numpy()
    return end > t.send_end.to_numpy()


def transfer_bounds(df, link, rtt_s):
    """Per remote KV transfer (emulated seconds): measured and allowed duration from the
    sender's first byte. Columns id, measured_s, allowed_s, inflation, excess_s."""
    t = _remote_transfers(df)
    if not len(t):
        return pd.DataFrame(columns=["id", "measured_s", "allowed_s", "inflation", "excess_s"])
    start = t.send_start.to_numpy()
    allowed_end = np.maximum(_busy_until(t, link), t.send_end.to_numpy()) + rtt_s
    measured = t.kv_recv_end.to_numpy() - start
    allowed = allowed_end - start
    return pd.DataFrame({"id": t.id.to_numpy(), "measured_s": measured, "allowed_s": allowed,
                         "inflation": measured / allowed,
                         "excess_s": t.kv_recv_end.to_numpy() - allowed_end})


def path_allowance(run, links):
    """(emulated seconds, basis): what the model allows after a transfer's last byte, one
    round trip and three configured jitter deviations. The round trip is the larger of the
    configured one and the median the link probe measured at rest on this run's KV direction
    (metadata `link_fidelity`, before the requests): a configured 0 ms WAN still takes the
    stack's own time to cross (veths, the router, the receiver's wake-up: 0.03-0.07 ms here),
    which at `scale.time` 40 is a visible share of the shortest transfers. The probe's jitter
    and tail are not used: they follow the machine's load while it probed, and lateness beyond
    the path's median at rest (a receiver descheduled during the requests) is the emulation's,
    which the guard is there to report."""
    kv, req = links["kv"], links["request"]
    rtt = kv.delay_s + req.delay_s
    measured = ((run.metadata or {}).get("link_fidelity") or {}).get("measured") or {}
    m_rtt, basis = measured.get("rtt_p50_ms"), "configured"
    if m_rtt is not None and math.isfinite(m_rtt) and m_rtt / 1e3 > rtt:
        rtt, basis = m_rtt / 1e3, "measured"
    return rtt + 3 * kv.jitter_s, basis


def kv_transfers(df, run, ts, links):
    """Summary of `transfer_bounds` in real-world units, and a warning when any is inflated."""
    rtt, basis = path_allowance(run, links)
    b = transfer_bounds(df, link_model(run, ts, links), rtt)
    s = run.scale
    bad = b[b.inflation > 1 + INFLATION_TOL]
    out = {"transfers": int(len(b)), "inflated": int(len(bad)), "tolerance": INFLATION_TOL,
           "path_allowance_ms": float(s.real_ms(rtt)), "path_basis": basis,
           "median_inflation": _q(b.inflation, 50), "p90_inflation": _q(b.inflation, 90),
           "max_inflation": _q(b.inflation, 100),
           "excess_total_s": float(s.real_s(bad.excess_s.sum())),
           "median_excess_ms": _q(s.real_ms(bad.excess_s), 50)}
    warn = []
    if len(bad):
        warn.append(f"{len(bad)} of {len(b)} KV transfers took more than {1 + INFLATION_TOL:g}x "
                    f"what the link model allows (median {out['median_inflation']:.2f}x, max "
                    f"{out['max_inflation']:.2f}x; inflated ones {out['median_excess_ms']:.0f} ms "
                    f"over it (median), {out['excess_total_s']:.1f} s in total, real-world)")
    return out, warn


def link_shortfall(df, run, ts, links, meta):
    """Whether the link probe's goodput warning (metadata `link_fidelity`: bulk TCP carried
    less than the rate, beyond the probe's tolerance) bears on what this run measured; None
    when the probe gave no such warning. A link that carried `carried` of its rate in bulk
    bears when at that rate some remote KV transfer could have been held past its sender's last
    byte (`_link_bound` on the model of `transfer_bounds`, its rate times `carried`:
    `link_bound`), or when some counter sample of the kv direction carried more than that
    (`samples_above`). Where neither, every transfer was paced by its sender (a prefill streams
    its KV layer by layer) and the link never ran near the rate the machine fell short of: the
    shortfall could not have moved a transfer, a TTFT or the egress. The run's own transfers are
    still judged against the full rate (`kv_transfers`)."""
    fid = meta.get("link_fidelity") or {}
    dev = (fid.get("deviation") or {}).get("goodput")
    warning = None if dev is None or dev >= 0 else deviation_warning("goodput", dev)
    if warning is None or warning not in fid.get("warnings", ()):
        return None
    carried = 1 + dev
    model = link_model(run, ts, links)
    t = _remote_transfers(df)
    bound = _link_bound(t, FluidLink(model.t, model.rate * carried))
    peak, above = None, 0
    if ts is not None and len(ts) and "kv_rate_bps" in ts and "kv_link_gbps" in ts:
        rate = _kv_link_bps(run, ts)
        keep = ~artifact_mask(ts, "kv").to_numpy() & (rate > 0)
        share = ts.kv_rate_bps.to_numpy()[keep] / rate[keep]
        peak = float(share.max()) if len(share) else None
        above = int((share > carried).sum())
    return {"warning": warning, "carried": round(carried, 4),
            "transfers": int(len(t)), "link_bound": int(bound.sum()),
            "samples_above": above, "peak_share": None if peak is None else round(peak, 4),
            "bears": bool(bound.any() or above)}


def _q(series, q):
    s = pd.Series(series).replace([np.inf, -np.inf], np.nan).dropna()
    return float(np.percentile(s, q)) if len(s) else None


# ---------------------------------------------------------------- kernel TCP counters

def _parse_proc(text, wanted):
    """{name: value} of `wanted` ({section: names}) from /proc/net/netstat or snmp text: each
    section is a header line of names and a line of values."""
    out, lines = {}, text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        sec = names.split(":", 1)[0]
        if sec not in wanted:
            continue
        row = dict(zip(names.split()[1:], values.split()[1:]))
        out.update({k: int(row[k]) for k in wanted[sec] if k in row})
    return out


def _read_netns_file(ns_path, name):
    """/proc/net/<name> as seen in the namespace at `ns_path`. For a process's namespace
    (/proc/<pid>/ns/net) that is /proc/<pid>/net/<name>; otherwise read inside it."""
    m = re.fullmatch(r"/proc/(\d+)/ns/net", ns_path)
    if m:
        with open(f"/proc/{m.group(1)}/net/{name}") as f:
            return f.read()
    return ns_run(ns_path, ["cat", f"/proc/net/{name}"], capture_output=True, text=True,
                  check=True, timeout=10).stdout


def tcp_counters(ns_path):
    """{TCPTimeouts, TCPLossProbes, RetransSegs} of one network namespace."""
    out = _parse_proc(_read_netns_file(ns_path, "netstat"), {"TcpExt": TCP_COUNTERS["TcpExt"]})
    out.update(_parse_proc(_read_netns_file(ns_path, "snmp"), {"Tcp": TCP_COUNTERS["Tcp"]}))
    return out


def host_tcp_counters(ns_paths):
    """{host: counters} for {host: netns path}; a host that is gone is left out."""
    out = {}
    for host, path in ns_paths.items():
        try:
            out[host] = tcp_counters(path)
        except (OSError, subprocess.SubprocessError):
            continue
    return out


def counter_delta(before, after):
    """Per host, after - before, for hosts present in both."""
    return {h: {k: after[h][k] - before[h].get(k, 0) for k in after[h]}
            for h in after if h in before}


def tcp_summary(delta):
    """Totals over hosts, the hosts with any timeout, and a warning when there were timeouts."""
    names = [n for sec in TCP_COUNTERS.values() for n in sec]
    out = {n: int(sum(c.get(n, 0) for c in delta.values())) for n in names}
    out["hosts_with_timeouts"] = {h: c["TCPTimeouts"] for h, c in sorted(delta.items())
                                  if c.get("TCPTimeouts")}
    warn = []
    if out["TCPTimeouts"]:
        warn.append(f"{out['TCPTimeouts']} TCP retransmission timeouts during the requests "
                    f"({out['TCPLossProbes']} tail-loss probes, {out['RetransSegs']} segments "
                    f"retransmitted) on {', '.join(out['hosts_with_timeouts'])}: each stalls a "
                    f"transfer for at least the RTO (metadata tcp.timers)")
    return out, warn


# ---------------------------------------------------------------- start-up warnings

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) WARNING (.*)$")


def startup_warnings(logs_dir, before_s):
    """Warning lines of the worker logs (`workers.common.setup_logging` format, local time)
    stamped before `before_s` (epoch seconds: the client's start): a summary and a warning."""
    lines = []
    for f in sorted(pathlib.Path(logs_dir).glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = LOG_LINE.match(line)
            if m and datetime.datetime.strptime(
                    m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() < before_s:
                lines.append((m[2], m[3]))
    out = {"warnings": len(lines), "workers": len({w for w, _ in lines})}
    if not lines:
        return out, []
    out["first"] = f"{lines[0][0]}: {lines[0][1]}"
    return out, [f"{out['warnings']} warnings in {out['workers']} worker logs before the requests "
                 f"started (e.g. {out['first']}); see logs/"]


# ---------------------------------------------------------------- the summary

def guards(df, run, ts, meta, links, logs_dir=None):
    """{'fidelity': {...}} for summary.json and the warnings, from the analysed run
    (`run`: testbed.rundir.RunInfo; `links`: its emulated links, deployment.json; `logs_dir`:
    its worker logs)."""
    transfers, warn = kv_transfers(df, run, ts, links)
    out = {"kv_transfers": transfers, "rate_artifacts": rate_artifacts(ts),
           "link_shortfall": link_shortfall(df, run, ts, links, meta)}
    if logs_dir is not None and meta.get("client_start_at") is not None:
        out["startup"], w = startup_warnings(logs_dir, meta["client_start_at"])
        warn += w
    art = out["rate_artifacts"]
    if art.get("kv") or art.get("request"):
        warn.append(f"{art['kv']} KV and {art['request']} request-direction counter samples "
                    f"(of {art['samples']}) exceed the link rate beyond sampling jitter: "
                    f"left out of egress statistics and plots")
    if meta.get("tcp_counters") is not None:
        out["tcp"], w = tcp_summary(meta["tcp_counters"])
        warn += w
    return {"fidelity": out}, warn
