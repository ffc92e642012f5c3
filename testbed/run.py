"""Run: one experiment file, every variant in turn, on a freshly built network each time.

For each expanded run (`config.load_experiment`): write the resolved config and the request
list, build the network (`net.build.Network`), start the workers inside their Mininet hosts and
wait (bounded) for each to report ready, probe the WAN as built, sample the kernel counters,
start the open-loop client, show progress, then tear everything down in reverse order, also on
Ctrl-C or when a worker dies. Analysis (`metrics`) and figures (`plot`) read only the run
directory afterwards.
"""

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import secrets
import signal
import subprocess
import sys
import time

import yaml

from testbed import (__version__, config, fidelity, kvwire, lifecycle, loadgen, metrics,
                     ownership, plot)
from testbed.errors import ConfigError, PrivilegeError, RunInterrupted, WorkerError
from testbed.measure import CounterSampler, EventLog
from testbed.workload import generate

REPO = pathlib.Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0
GRPC_PORT, KV_PORT, CACHE_PORT = 50051, 50052, 50053


def _adaptive(exp):
    """The threshold controller's settings in emulation units, or None when it is off."""
    a = exp.scheduler.adaptive
    if not (a.enabled and exp.scheduler.policy == "prfaas"):
        return None
    return {"interval_s": a.interval / exp.scale.time, "window_s": a.window / exp.scale.time,
            "dwell_s": a.dwell / exp.scale.time, "egress_high": a.egress_high,
            "egress_low": a.egress_low, "queue_ratio": a.queue_ratio, "step": a.step,
            "min": a.min, "max": a.max,
            # timeseries' kv_link_gbps is real-world Gbit/s; its kv_rate_bps is emulated bit/s
            "link_to_emulated_bps": 1e9 * exp.scale.bytes * exp.scale.time}


def _roles(exp):
    """The long timescale's settings (emulated seconds; the planner's inputs real-world), or
    None when it is off."""
    r = exp.scheduler.roles
    if not r.enabled:
        return None
    from testbed import plan
    return {"interval_s": r.interval / exp.scale.time, "window_s": r.window / exp.scale.time,
            "min_requests": r.min_requests, "cost_s": r.cost / exp.scale.time, "gain": r.gain,
            "retune": r.retune, "wan_rate_bps": plan.wan_kv_rate_bps(exp)}


def _system_cc():
    return pathlib.Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def default_out(exp_name):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return REPO / "results" / exp_name / f"{stamp}-{secrets.token_hex(2)}"


def _git_revision():
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions():
    from importlib import metadata

    out = {"testbed": __version__, "python": platform.python_version()}
    for pkg in ("torch", "grpcio", "pyroute2", "pandas", "numpy", "seaborn", "mininet"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    with contextlib.suppress(ImportError):
        import mininet.net
        out["mininet"] = mininet.net.VERSION
    return out


def _cache_runtime(exp, prof, inst):
    """The prefix cache's settings in emulation units; adds a pool per cluster to `inst`."""
    c = exp.cache
    if not c.enabled:
        return {"enabled": False, "placement": exp.scheduler.placement}
    for dc, name in (("prfaas", "pool_prfaas"), ("local", "pool_local")):
        inst[name] = {"role": "cachepool", "dc": dc, "accelerator": "",
                      "cache_capacity": int(config.cache_capacity(exp, prof, dc)
                                            * exp.scale.bytes)}
    return {"enabled": True, "block": c.block, "snapshot_every": c.snapshot_every,
            "placement": exp.scheduler.placement, "transfer": c.transfer,
            "headroom": c.headroom, "s_kv": list(prof.kv_size.coeffs),
            "bytes_scale": exp.scale.bytes,
            # timeseries' kv_link_gbps is real-world Gbit/s; its kv_rate_bps is emulated bit/s
            "link_to_emulated_bps": 1e9 * exp.scale.bytes * exp.scale.time}


def runtime_for(exp, net):
    """The description every worker reads (runtime.json): instances, scale, policy, timeouts."""
    t = exp.scale.time
    prof_decode = exp.model.decode_step
    inst = {}
    c = exp.clusters
    for i in range(c.prfaas.instances):
        inst[f"rp{i}"] = {"role": "prefill", "dc": "prfaas", "accelerator": c.prfaas.accelerator}
    for i in range(c.local.prefill):
        inst[f"lp{i}"] = {"role": "prefill", "dc": "local", "accelerator": c.local.accelerator}
    for i in range(c.local.decode):
        inst[f"ld{i}"] = {"role": "decode", "dc": "local", "accelerator": c.local.accelerator}
    if exp.scheduler.roles.enabled:       # `role` is then the role each starts in
        for d in inst.values():
            if d["dc"] == "local":
                d["worker"] = "dualrole"
    inst["scheduler"] = {"role": "scheduler", "dc": "local", "accelerator": ""}
    inst["client"] = {"role": "client", "dc": "local", "accelerator": ""}
    from testbed import profile as profiles
    prof = profiles.load(exp.model.profile)
    cache = _cache_runtime(exp, prof, inst)
    for name, d in inst.items():
        d.update(ip=net.ip(name), grpc_port=GRPC_PORT, kv_port=KV_PORT, cache_port=CACHE_PORT)
    return {
        "cache": cache,
        "name": exp.name, "label": exp.label, "seed": exp.seed,
        "scale": {"time": t, "bytes": exp.scale.bytes, "tokens": exp.scale.tokens},
        "profile": exp.model.profile, "engine": exp.model.engine,
        "device": exp.model.device, "torch": {"seed": exp.seed, **exp.model.torch},
        "decode": {"step_s": prof_decode if prof_decode is not None else prof.decode_step_s,
                   "bs_max": exp.model.bs_max or prof.bs_max,
                   "model": dataclasses.asdict(exp.decode_model())},     # real-world
        "scheduler": {"policy": exp.scheduler.policy, "threshold": exp.scheduler.threshold,
                      "failover": exp.scheduler.failover.enabled,
                      "health_interval_s": exp.scheduler.failover.interval / t,
                      "health_timeout_s": exp.scheduler.failover.timeout / t,
                      "failover_max_local": exp.scheduler.failover.max_local,
                      "adaptive": _adaptive(exp), "roles": _roles(exp)},
        "kv_deadline_s": exp.run.kv_deadline / t,
        "token_flush_s": exp.run.token_flush / t,
        "request_timeout_s": exp.run.request_timeout / t,
        "drain_timeout_s": exp.run.drain_timeout / t,
        "instances": inst,
        "frontdoor": loadgen.runtime(exp),
    }


class Progress:
    """Counts completed requests in requests.jsonl as the client appends them; a tqdm bar."""

    def __init__(self, path, total, label, enabled=True):
        self.path, self.total = path, total
        self.pos = 0
        self.done = 0
        self.failed = 0
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=f"{label:>12}", unit="req", file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    def poll(self):
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.pos)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self.pos += len(complete.encode())
        for line in complete.splitlines():
            if '"ev":"done"' in line:
                self.done += 1
                if '"status":"ok"' not in line:
                    self.failed += 1
                if self.bar:
                    self.bar.update(1)
                    self.bar.set_postfix(failed=self.failed, refresh=False)

    def write(self, msg):
        (self.bar.write if self.bar else print)(msg, file=sys.stderr)

    def close(self):
        if self.bar:
            self.bar.close()


class Run:
    """One expanded run: build, start, drive, tear down. `execute()` returns the run dir."""

    def __init__(self, exp, run_dir, probe=True, cli=False, progress=True):
        self.exp, self.dir = exp, pathlib.Path(run_dir)
        self.probe, self.cli, self.progress = probe, cli, progress
        self.meta = {}
        self.procs = {}

    def execute(self):
        exp, d = self.exp, self.dir
        (d / "logs").mkdir(parents=True, exist_ok=True)
        (d / "config.yaml").write_text(yaml.safe_dump(config.resolved(exp), sort_keys=False))
        workload = generate(exp.workload, exp.seed, requests=exp.requests,
                            duration_s=exp.duration)
        workload.to_parquet(d / "workload.parquet", index=False)
        self.meta = {"name": exp.name, "label": exp.label, "git_revision": _git_revision(),
                     "kernel": platform.release(), "host": platform.node(),
                     "versions": _versions(), "argv": sys.argv, "start_time": time.time(),
                     "scale": config.resolved(exp)["scale"], "requests": len(workload)}
        registry = lifecycle.Registry(secrets.token_hex(2))
        events = EventLog(d / "events.csv")
        self.meta["run_id"] = registry.run_id
        interrupted, error = False, None
        counters = {}
        try:
            from testbed.net.build import Network
            net = Network(exp, registry, events).start()
            self._describe_network(net)
            rt = runtime_for(exp, net)
            (d / "runtime.json").write_text(json.dumps(rt, indent=1))
            self._start_workers(net, rt, events)
            if self.probe:
                self._probe(net)
            else:
                self.meta["link_fidelity"] = {"skipped": "--no-probe"}
            if self.cli:
                net.cli()
            sampler = CounterSampler(net.wan, d / "timeseries.csv", exp.scale.time,
                                     exp.scale.bytes).start()
            tcp_before = fidelity.host_tcp_counters(net.netns_path)
            try:
                self._drive(net, rt, workload, events)
            finally:
                counters = sampler.stop()
                self.meta["tcp_counters"] = fidelity.counter_delta(
                    tcp_before, fidelity.host_tcp_counters(net.netns_path))
        except KeyboardInterrupt:
            interrupted = True
            events("interrupted")
        except Exception as e:      # torn down below; what was measured is still analysed
            error = e
            events("error", error=f"{type(e).__name__}: {e}")
        finally:
            errors = registry.close()
            self.meta["end_time"] = time.time()
            self.meta["teardown_errors"] = errors
            self.meta["wan_counters"] = counters
            (d / "metadata.json").write_text(json.dumps(self.meta, indent=1, default=str))
            events.close()
        summary = metrics.analyse(d, exp)
        if interrupted:
            raise RunInterrupted(f"interrupted; what was measured is in {d}")
        if error is not None:
            raise error
        return summary

    def _describe_network(self, net):
        self.meta["topology"] = {"class": "topologies.two_dc.TwoDatacenterTopo",
                                 "nodes": dict(net.topo.roles), "ips": dict(net.topo.ips),
                                 "router_egress": dict(net.topo.router_intfs)}
        self.meta["tcp"] = {"congestion_control_kv": self.congestion_control(),
                            "congestion_control_default": _system_cc(),
                            "segmentation_offload": not net.per_frame,
                            "timers": net.tcp_timers}
        self.meta["shaping"] = {"backend": net.wan.backend,
                                "reason": getattr(net.wan, "backend_reason", ""),
                                "emulated": {k: self.exp.emulated_direction(k)
                                             for k in ("kv", "request")}}

    def congestion_control(self):
        """TCP congestion control of the KV senders and the link probe."""
        cc = self.exp.network.congestion_control
        return _system_cc() if cc == "system" else cc

    def _spawn(self, net, name, module, rt, extra=(), host=None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env[kvwire.CC_ENV] = self.congestion_control()
        argv = [sys.executable, "-m", module, "--runtime", str(self.dir / "runtime.json"),
                "--name", name, *extra]
        self.procs[name] = net.popen(host or name, argv, self.dir / "logs" / f"{name}.log",
                                     env=env)

    def _stop_processes(self):
        """SIGTERM every process of the run (client first), then SIGKILL what is left."""
        live = [p for p in reversed(list(self.procs.values())) if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in live:
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=2)

    def _start_workers(self, net, rt, events):
        # Registered after the network's teardown, so it runs before it (reverse order).
        net.registry.on_close(self._stop_processes, "processes")
        for name, inst in rt["instances"].items():
            if inst["role"] in ("prefill", "decode", "cachepool"):
                self._spawn(net, name, f"workers.{inst.get('worker', inst['role'])}", rt)
        self._spawn(net, "scheduler", "workers.scheduler", rt)
        if self.exp.workload.client != "builtin":     # an external client's front door
            self._spawn(net, "frontdoor", "workers.frontdoor", rt, host="client", extra=[
                "--out", str(self.dir / "requests.jsonl"),
                "--http-log", str(self.dir / "frontdoor.jsonl")])
        self._wait_ready(list(self.procs))
        events("workers_ready", count=len(self.procs))

    def _wait_ready(self, names):
        """Wait (bounded) until every process in `names` has written its ready file."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = set(names)
        while pending:
            for name in list(pending):
                if (self.dir / "ready" / name).exists():
                    pending.discard(name)
                elif self.procs[name].poll() is not None:
                    raise WorkerError(f"{name} exited with code {self.procs[name].returncode} "
                                      f"before it was ready; see {self.dir}/logs/{name}.log")
            if pending and time.monotonic() > deadline:
                raise WorkerError(f"not ready after {READY_TIMEOUT_S:.0f}s: "
                                  f"{', '.join(sorted(pending))}; see {self.dir}/logs/")
            time.sleep(0.01)

    def _probe(self, net):
        from testbed.net.probe import measure_link

        paths = net.netns_path
        os.environ[kvwire.CC_ENV] = self.congestion_control()   # the probe's TCP sender
        self.meta["link_fidelity"] = measure_link(
            paths["probe_remote"], paths["probe_local"], net.ip("probe_local"),
            configured=self.exp.emulated_direction("kv"))

    def _link_schedule(self, net, events, warn, occurrences=()):
        from testbed.faults import link_items
        from testbed.net.schedule import LinkSchedule

        trace = self.exp.network.wan.rate_trace
        rows = config.read_rate_trace(trace.path) if trace is not None else []
        if trace is not None and trace.loop and rows:
            # Repeat the trace to cover the longest the run may last.
            period, horizon = rows[-1][0], self.exp.run.drain_timeout * 4
            if period > 0:
                n = int(horizon / period) + 1
                rows = [(t + k * period, r) for k in range(n) for t, r in rows]
        items = self.exp.emulated_changes(rows)
        items = sorted(items + link_items(self.exp, occurrences, items), key=lambda x: x[0])
        return LinkSchedule(net.wan, items, events, warn)

    def _respawn(self, net, rt, events, name):
        """A `restart` fault: start a killed worker again; it rejoins through the health check."""
        (self.dir / "ready" / name).unlink(missing_ok=True)
        i = rt["instances"][name]
        self._spawn(net, name, f"workers.{i.get('worker', i['role'])}", rt)
        events("worker_restarted", name=name, pid=self.procs[name].pid)

    def _drive(self, net, rt, workload, events):
        records = self.dir / "requests.jsonl"
        builtin = self.exp.workload.client == "builtin"
        if builtin:
            start_file = self.dir / "ready" / "start_at"
            self._spawn(net, "client", "workers.client", rt,
                        ["--workload", str(self.dir / "workload.parquet"), "--out", str(records),
                         "--start-file", str(start_file)])
            self._wait_ready(["client"])
        # Arrival 0 is chosen once the client is ready, so the client's start-up time (seconds
        # on a loaded machine) never shifts the arrivals against link changes and faults.
        start_at = time.time() + 0.1
        if builtin:
            tmp = start_file.with_suffix(".tmp")
            tmp.write_text(f"{start_at:.6f}")
            tmp.rename(start_file)
        else:       # command or aiperf through the front door (ready with the workers)
            loadgen.start_client(self, net, rt, workload)
        self.meta["client_start_at"] = start_at
        events("client_started", requests=len(workload))
        progress = Progress(records, len(workload), self.exp.label, self.progress)
        from testbed import faults
        occurrences = faults.resolve(self.exp)
        schedule = self._link_schedule(net, events, progress.write, occurrences).start(start_at)
        injector = faults.Injector(occurrences, self.exp.scale.time, self.dir, lambda: self.procs,
                                   lambda n: self._respawn(net, rt, events, n),
                                   events).start(start_at)
        last_arrival = float(workload.arrival_s.max()) if len(workload) else 0.0
        bound = start_at + last_arrival / self.exp.scale.time + rt["drain_timeout_s"] + 30.0
        dead = set()
        client = self.procs["client"]
        try:
            while client.poll() is None:
                progress.poll()
                for name, p in list(self.procs.items()):
                    if name != "client" and p not in dead and p.poll() is not None:
                        dead.add(p)
                        events("worker_died", name=name, code=p.returncode)
                        progress.write(f"warning: {name} exited with code {p.returncode}; "
                                       f"its requests fail (see logs/{name}.log)")
                if time.time() > bound:
                    events("client_timeout")
                    progress.write("warning: the run outlived its bound; stopping the client")
                    client.send_signal(signal.SIGTERM)
                    client.wait(timeout=10)
                    break
                time.sleep(0.1)
            progress.poll()
        finally:
            injector.stop()
            schedule.stop()
            progress.close()
            self.meta["link_schedule_errors"] = [
                {"at_s": t, "direction": d or "both", "changes": c, "error": e}
                for t, d, c, e in schedule.errors]
        events("client_finished", code=client.returncode)
        self.meta["dead_workers"] = sorted(n for n, p in self.procs.items() if p in dead)


def execute(path, overrides=(), out=None, probe=True, cli=False, progress=True):
    """Run every variant of an experiment file; returns (top run dir, list of summaries)."""
    runs = config.load_experiment(path, overrides)
    if out:
        check_out(out)
    if os.geteuid() != 0:
        raise PrivilegeError("testbed run builds network namespaces and needs root: use sudo")
    top = pathlib.Path(out) if out else default_out(runs[0].name)
    made = ownership.missing_ancestors(top)
    top.mkdir(parents=True, exist_ok=True)
    summaries = []
    try:
        for exp in runs:
            run_dir = top / exp.label if len(runs) > 1 else top   # a safe name (config.validate)
            summaries.append(Run(exp, run_dir, probe=probe, cli=cli, progress=progress).execute())
        if len(runs) > 1:
            metrics.write_sweep(top, summaries)
            if any(exp.faults for exp in runs):
                from testbed import faults
                faults.write_matrix(top, runs, summaries)
        plot.run_figures(top)
    finally:    # also on Ctrl-C and errors: what sudo made belongs to the user who ran it
        ownership.hand_back(top)
        ownership.hand_back(*made[1:], recursive=False)
    return top, summaries


def check_out(out):
    """`--out` must not exist yet or be an empty directory: a run never appends to old records."""
    p = pathlib.Path(out)
    if not p.exists() and not p.is_symlink():
        return
    if not p.is_dir():
        raise ConfigError("--out exists and is not a directory; give a new or empty directory",
                          path=str(out))
    try:
        n = sum(1 for _ in p.iterdir())
    except OSError as e:
        raise ConfigError(f"--out cannot be read ({e.strerror}); give a new or empty directory",
                          path=str(out)) from None
    if n:
        raise ConfigError(f"--out is not empty ({n} entries); give a new or empty directory "
                          "(a run never adds to an earlier run's records)", path=str(out))

