"""Dual-timescale control figure (docs/control.md), drawn from run directories only.

`control_timeline`: per run, against real-world time since the first arrival, (1) the local
prefill instances N_p (runtime.json's starting split, then each `role` event of events.csv: the
instance leaves its old role when draining starts and joins the new one when the conversion is
done), (2) the threshold t in force (scheduler.csv when the short timescale ran, else the
configured one), (3) the PrfaaS prefill backlog per instance the controller measured, and (4)
TTFT by arrival: roles and t against queues and latency.
"""

import matplotlib.pyplot as plt

from testbed import rundir


def _events(d, kind):
    """[(time, fields)] of one kind of events.csv row, on the orchestrator's clock."""
    clock = rundir.metadata(d).get("clocks")
    return [(t, f) for t, k, f in rundir.read_events(rundir.RunDir(d).events, clock) if k == kind]


def _prefill_steps(d, rt):
    """[(time, N_p)] from the starting split and the role events."""
    n = sum(1 for i in rt["instances"].values() if i["dc"] == "local" and i["role"] == "prefill")
    steps = [(None, n)]
    for t, f in _events(d, "role"):
        if f.get("state") == "draining" and f.get("from") == "prefill":
            n -= 1
        elif f.get("state") == "done" and f.get("to") == "prefill":
            n += 1
        else:
            continue
        steps.append((t, n))
    return steps


def control_timeline(top, out_dir, find_runs, label, save):
    runs = []
    for d in find_runs(top):
        rt = rundir.runtime(d)
        if rt is not None:
            runs.append((d, rundir.summary(d), rt))
    if not any(rt["scheduler"].get("roles") or rt["scheduler"].get("adaptive")
               for _, _, rt in runs):
        return None         # static runs beside a controlled one, not on their own
    fig, axes = plt.subplots(4, 1, figsize=(6.5, 7.5), sharex=True)
    for d, s, rt in runs:
        scale = rundir.scale(d)
        t0 = rundir.metadata(d).get("client_start_at")
        req = rundir.requests(d)
        end = float(req.arrival_s.max()) if len(req) else 0.0
        clock = (lambda t: scale.real_s(t - t0)) if t0 else (lambda t: t)
        steps = _prefill_steps(d, rt)
        xs = [0.0] + [clock(t) for t, _ in steps[1:]] + [end]
        ys = [n for _, n in steps] + [steps[-1][1]]
        line, = axes[0].step(xs, ys, where="post", label=label(s))
        color = line.get_color()
        sc = rundir.csv_table(d, rundir.RunDir.SCHEDULER)
        if sc is not None:
            sc = sc[clock(sc.time) >= 0]        # the timer's rows before the first arrival
            x = clock(sc.time)
            axes[1].step(x, sc.threshold, where="post", color=color)
            axes[2].plot(x, scale.real_s(sc.backlog_remote_s), color=color, linewidth=0.8)
        else:
            axes[1].step([0, end], [rt["scheduler"]["threshold"]] * 2, where="post", color=color)
        ok = req[req.status == "ok"]
        axes[3].scatter(ok.arrival_s, ok.ttft_ms, s=6, color=color, label=label(s))
    axes[0].set_ylabel("local prefill N_p")
    axes[1].set_ylabel("threshold t")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("PrfaaS backlog\n(s per instance)")
    axes[3].set_ylabel("TTFT (ms)")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("time since first arrival (s, real-world)")
    axes[0].legend()
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].set_title("Dual-timescale control: roles, threshold, PrfaaS queue, TTFT")
    return save(fig, out_dir, "control")
