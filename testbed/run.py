"""Run: one experiment file, every variant in turn, on a freshly built system each time
(`scale.time: auto`: a pilot's network reused, testbed/autoscale.py).

For each expanded run (`config.load_experiment`): compile its `testbed.deploy.Deployment` (once,
every run before the first starts), write the resolved config, the request list,
deployment.json and runtime.json (the workers' typed `WorkerRuntime`), start the backend
(`testbed.backend`: today Mininet, which builds the network and shapes the WAN), start the
workers on their instances and wait (bounded) for each to report ready, probe the WAN as built
(once per distinct WAN of the experiment, `measure.LinkProbes`: a variant with the same WAN
records the first one's probe, marked shared), sample the kernel counters, start the open-loop
client, the link schedule and the faults from the same instant, show progress, then tear
everything down in reverse order, also on Ctrl-C or when a worker dies. With an external
client (`workload.client: command | aiperf`) arrival 0 is the tool's: the link schedule and
faults start when its first request reaches the front door (minus that request's trace time),
not when the tool is started.
`Hold` (`testbed up`) forwards the front door to the root namespace's loopback
(testbed/net/forward.py) and the run lasts until Ctrl-C/SIGTERM; it runs no load generator
unless `load` (`up --load`: the built-in client replays the workload once, beside whatever
drives the front door; the front door's request ids then start after the workload's). Analysis
and figures read only the run directory afterwards. Nothing here imports Mininet.
"""

import contextlib
import dataclasses
import json
import datetime
from importlib import metadata
import os
import pathlib
import platform
import secrets
import signal
import subprocess
import sys
import time

from testbed import (analysis, autojudge, clocks, config, deploy, faultspec, fidelity, lifecycle,
                     loadgen, loadrun, ownership, plot, plot_load, replicates, rundir, runinputs,
                     sim, vllmrun)
from testbed.autoscale import AutoRun
from testbed.autoshare import Shared
from testbed.backend import open_backend, preflight
from testbed.errors import ConfigError, PrivilegeError, RunInterrupted, WorkerError
from testbed.experiment import AUTO
from testbed.faults import write_matrix
from testbed.inject import Injector
from testbed.live import serve, view
from testbed.loadstats import read_http
from testbed.measure import CounterSampler, LinkProbes, wan_meta
from testbed.net.schedule import LinkSchedule
from testbed.net.tcp import CC_ENV, congestion_control
from testbed.profiling import cost
from testbed.records import EventLog, RunDir
from testbed.sim.run import SimRun

REPO = pathlib.Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0
TAIL_FACTOR = 1e-3  # a pilot step's decode tail after its last first token: 1000x its speed


def default_out(exp_name):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return REPO / "results" / exp_name / f"{stamp}-{secrets.token_hex(2)}"


@dataclasses.dataclass(frozen=True)
class Hold:
    """`testbed up`: the front door forwarded to 127.0.0.1:`port` (0: a free port) until
    Ctrl-C/SIGTERM. `announce(info)` is called once it is up (the addresses). `load`: the
    built-in client replays the experiment's workload once (arrival 0 when it is up)."""
    port: int = 0
    announce: object = print
    load: bool = False


class Run:
    """One expanded run: build, start, drive (or hold), tear down. `execute()` returns the
    summary."""

    def __init__(self, exp, run_dir, probe=True, cli=False, progress=True, hold=None,
                 probes=None, deployment=None, backend=None, meta=None, tail=False):
        """`probes`: the `LinkProbes` shared by the runs of one experiment (a run whose WAN
        was probed already records that probe); by default this run's own. `deployment`: the
        run's compiled `Deployment` (`execute` compiles every run once, before any starts);
        compiled here when not given. `backend`: one already built and lent (its owner tears
        it down), carried over to this deployment (testbed/autoscale.py); `meta`: more
        metadata.json keys; `tail`: a pilot step's (profile engine): once the client has every
        first token, the decode workers run the rest `TAIL_FACTOR` times their time."""
        self.lent, self.extra_meta = backend, meta or {}
        self.exp, self.dir = exp, pathlib.Path(run_dir)
        self.rd = RunDir(run_dir)
        self.cli, self.progress = cli, progress
        self.probes = probes if probes is not None else LinkProbes(probe)
        self.hold = hold
        self.tail = tail and exp.model.engine == "profile"
        self.deployment = deployment if deployment is not None else deploy.compile(exp)
        self.rt = self.deployment.runtime
        self.backend = None
        self.meta = {}
        self.procs = {}
        self.retired = []            # a restarted worker's earlier lives (their CPU counts)
        self.vllm_pids = None        # vllmrun.PidRecord under model.engine vllm

    def execute(self):
        exp, d = self.exp, self.rd
        workload = self._write_description()
        registry = self.registry = lifecycle.Registry(secrets.token_hex(2))
        events = EventLog(d.events)
        self.meta["run_id"] = registry.run_id
        interrupted, error = False, None
        self.meta["phases_s"] = {}      # wall time of build, start-up and teardown
        self.counters = {}
        try:
            self._build_and_drive(workload, events)
        except KeyboardInterrupt:
            interrupted = True
            events("interrupted")
        except Exception as e:      # torn down below; what was measured is still analysed
            error = e
            events("error", error=f"{type(e).__name__}: {e}")
        finally:
            self._teardown(registry, events)
        if self.hold is not None and not read_http(d):
            # `up` that served nothing: no records to analyse (analysis needs one request)
            summary = {"label": exp.label, "requests": 0, "run_dir": str(d)}
        else:
            summary = analysis.analyse(d)
        if interrupted:
            raise RunInterrupted(f"interrupted; what was measured is in {d}")
        if error is not None:
            raise error
        return summary

    def _write_description(self):
        """The run's inputs and the metadata so far (testbed/runinputs.py, shared with the
        simulator); returns the request list."""
        workload = runinputs.write_inputs(self.exp, self.deployment, self.rd)
        self.meta = {**runinputs.base_metadata(self.exp, self.deployment, workload),
                     **self.extra_meta}
        self.workload_ids = int(workload.id.max()) + 1 if len(workload) else 0
        return workload

    def _build_and_drive(self, workload, events):
        """Build the backend, start the workers, probe the link, then drive (or hold)."""
        phases, dep = self.meta["phases_s"], self.deployment
        t0 = time.monotonic()
        self.backend = self.lent.rescale(dep, events) if self.lent else open_backend(
            self.exp.backend.kind, dep, self.registry, events, self.exp.backend,
            run_dir=self.dir).start()
        phases["build"] = round(time.monotonic() - t0, 3)
        self._describe_backend()
        t0 = time.monotonic()
        self._start_workers(self.registry, events)
        phases["workers_ready"] = round(time.monotonic() - t0, 3)
        self._probe_link(events)
        if self.cli:
            self.backend.cli()
        sampler = CounterSampler(self.backend.shaper, self.rd.timeseries, dep.scale).start()
        tcp_before = self.backend.tcp_counters()
        try:
            if self.hold is not None:
                self._hold(workload, events)
            else:
                self._drive(workload, events)
        finally:
            self.counters = sampler.stop()
            self.meta["tcp_counters"] = fidelity.counter_delta(
                tcp_before, self.backend.tcp_counters())

    def _teardown(self, registry, events):
        t0 = time.monotonic()
        errors = registry.close()
        self.meta["phases_s"]["teardown"] = round(time.monotonic() - t0, 3)
        self.meta["processes_cpu"] = cost.processes_cpu([*self.retired, *self.procs.values()])
        self.meta["end_time"] = time.time()
        self.meta["teardown_errors"] = errors
        if self.backend is not None:     # measured at start and at teardown
            self.meta["clocks"] = self.backend.clocks()
        self.meta["wan_counters"] = self.counters
        if self.rt.vllm is not None:
            self.meta["vllm"] = vllmrun.metadata(self.rd, self.rt)
        self.meta["cache_view"] = vllmrun.cache_view(self.rd, self.rt)
        rundir.write_metadata(self.dir, self.meta)
        events.close()

    def _describe_backend(self):
        desc = self.backend.describe()
        self.meta["versions"].update(desc["versions"])
        self.meta["topology"] = desc["topology"]
        wan = wan_meta(self.exp.backend.kind, desc, self.congestion_control())
        self.meta["tcp"], self.meta["shaping"] = wan["tcp"], wan["shaping"]
        self.meta["link_calibration"] = desc.get("link_calibration")

    def _probe_link(self, events):
        """link_fidelity: the WAN measured as built, or the probe of an earlier run of this
        experiment with the same WAN (`LinkProbes`)."""
        fid = self.meta["link_fidelity"] = self.probes.fidelity(
            self.exp.label, self.meta, lambda: self.backend.probe(self.congestion_control()))
        if "skipped" not in fid:
            events("link_probe", measured_in=fid["measured_in"], shared=fid["shared"])

    def congestion_control(self):
        """TCP congestion control of the KV senders and the link probe."""
        return congestion_control(self.exp.network.congestion_control)

    def _spawn(self, name, module, extra=(), host=None):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop(clocks.SKEW_ENV, None)   # test-only, a Ray node's own (never the orchestrator's)
        env[CC_ENV] = self.congestion_control()
        argv = [sys.executable, "-m", module, "--runtime", str(self.rd.runtime),
                "--name", name, *extra]
        self.procs[name] = self.backend.spawn(host or name, argv, self.rd.log(name), env=env)

    def _stop_processes(self):
        """SIGTERM every process of the run (client first), then SIGKILL what is left."""
        lifecycle.terminate_all(reversed(list(self.procs.values())),   # vLLM: its servers too
                                grace_s=3.0 if self.rt.vllm is None else 20.0)

    def _start_workers(self, registry, events):
        # Registered after the backend's teardown, so it runs before it (reverse order).
        registry.on_close(self._stop_processes, "processes")
        if self.rt.vllm is not None:
            vllmrun.ensure_model(self.rt)
        # Servers first: decode and cache pool workers listen, prefill workers connect to them
        # while they warm up (a sort on a bool is stable: the deployment order stays otherwise).
        for inst in sorted(self.deployment.workers(), key=lambda i: i.role == "prefill"):
            self._spawn(inst.name, inst.module)
        self._spawn("scheduler", self.rt.instance("scheduler").module)
        if self.exp.workload.client != "builtin":     # an external client's front door
            first_id = self.workload_ids if self.hold is not None and self.hold.load else 0
            self._spawn("frontdoor", "workers.frontdoor", host="client", extra=[
                "--out", str(self.rd.records),
                "--http-log", str(self.rd.frontdoor),
                "--first-request-file", str(self.rd.first_request),
                "--first-id", str(first_id)])
        self._wait_ready(list(self.procs))
        if self.rt.vllm is not None:
            self.vllm_pids = vllmrun.PidRecord(self.rd, registry)
            self.vllm_pids.refresh(force=True)
        events("workers_ready", count=len(self.procs))

    def _wait_ready(self, names):
        """Wait (bounded) until every process in `names` has written its ready file."""
        bound = READY_TIMEOUT_S + (0 if self.rt.vllm is None else 2 * self.rt.vllm.start_timeout_s)
        deadline = time.monotonic() + bound
        pending = set(names)
        while pending:
            for name in list(pending):
                if self.rd.ready_file(name).exists():
                    pending.discard(name)
                elif self.procs[name].poll() is not None:
                    raise WorkerError(f"{name} exited with code {self.procs[name].returncode} "
                                      f"before it was ready; see {self.dir}/logs/{name}.log")
            if pending and time.monotonic() > deadline:
                raise WorkerError(f"not ready after {bound:.0f}s: "
                                  f"{', '.join(sorted(pending))}; see {self.dir}/logs/")
            time.sleep(0.01)

    def _link_schedule(self, events, warn):
        return LinkSchedule(self.backend.shaper, [c.item() for c in self.deployment.link_changes],
                            events, warn)

    def _respawn(self, events, name):
        """A `restart` fault: start a killed worker again; it rejoins through the health check."""
        self.rd.ready_file(name).unlink(missing_ok=True)
        if name in self.procs:
            self.retired.append(self.procs[name])
        self._spawn(name, self.rt.instance(name).module)
        events("worker_restarted", name=name, pid=self.procs[name].pid)

    def _start_client(self):
        """Start the built-in client and, once it is ready, its arrival 0 (returned): the
        client's start-up time (seconds on a loaded machine) never shifts the arrivals
        against link changes and faults."""
        start_file = self.rd.start_at
        self._spawn("client", self.rt.instance("client").module,
                    ["--workload", str(self.rd.workload), "--out", str(self.rd.records),
                     "--start-file", str(start_file),
                     *(["--first-tokens-file", str(self.rd.first_tokens)]
                       if self.tail else [])])
        self._wait_ready(["client"])
        start_at = time.time() + 0.1
        tmp = start_file.with_suffix(".tmp")     # read on the client host's clock
        tmp.write_text(f"{start_at + self.client_clock_offset():.6f}")
        tmp.rename(start_file)
        return start_at

    def _drive(self, workload, events):
        records = self.rd.records
        if self.exp.workload.client == "builtin":
            start_at = self._start_client()
        else:       # command or aiperf through the front door (ready with the workers)
            start_at = loadrun.arrival_zero(self, workload, events)
        self.meta["client_start_at"] = start_at
        events("client_started", requests=len(workload))
        progress = view.tracker(self.progress, self.dir, records, len(workload), self.exp.label)
        schedule, injector = self._start_schedules(start_at, events, progress.write)
        last_arrival = float(workload.arrival_s.max()) if len(workload) else 0.0
        bound = (start_at + self.deployment.scale.emulated_s(last_arrival)
                 + self.rt.drain_timeout_s + 30.0)
        dead, cut = set(), not self.tail
        client = self.procs["client"]
        try:
            while client.poll() is None:
                progress.poll()
                if not cut and self.rd.first_tokens.exists():   # a pilot step's
                    cut = injector.fast_tail([i.name for i in self.rt.instances.values()
                                              if i.may_decode], TAIL_FACTOR)
                self._check_workers(dead, events, progress.write)
                if self.vllm_pids:       # also a server that a `restart` fault started
                    self.vllm_pids.refresh()
                if time.time() > bound:
                    events("client_timeout")
                    progress.write("warning: the run outlived its bound; stopping the client")
                    client.send_signal(signal.SIGTERM)
                    client.wait(timeout=10)
                    break
                time.sleep(0.1)
            progress.poll()
        finally:
            self._stop_schedules(schedule, injector)
            progress.close()
        events("client_finished", code=client.returncode)
        self.meta["dead_workers"] = sorted(n for n, p in self.procs.items() if p in dead)

    def client_clock_offset(self):
        """The client host's clock minus this one's, as the backend measured it (0 on one
        machine): the runner's times to and from the client are moved by it."""
        return clocks.instance_offsets(self.backend.clocks()).get("client", 0.0)

    def _start_schedules(self, start_at, events, warn):
        """The link schedule and the faults, both timed from arrival 0 = `start_at`."""
        schedule = self._link_schedule(events, warn).start(start_at)
        injector = Injector(self.deployment.fault_actions, self.dir, lambda: self.procs,
                                   lambda n: self._respawn(events, n), events).start(start_at)
        return schedule, injector

    def _stop_schedules(self, schedule, injector):
        injector.stop()
        schedule.stop()
        self.meta["link_schedule_errors"] = [
            {"at_s": t, "direction": d or "both", "changes": c, "error": e}
            for t, d, c, e in schedule.errors]
        # the faults as resolved (kinds, targets, times) and what the link events did
        self.meta["faults"] = [o.as_dict() for o in faultspec.resolve(self.exp,
                                                                     self.deployment.instances)]
        shaper = self.backend.shaper
        if hasattr(shaper, "event_counters") and any(o["kind"] in faultspec.EVENTS
                                                     for o in self.meta["faults"]):
            self.meta["link_event_packets"] = shaper.event_counters()
        if hasattr(shaper, "police_drops") and self.deployment.sets("police"):
            self.meta["police_drops"] = shaper.police_drops()    # packets, per direction

    def _check_workers(self, dead, events, warn):
        """Record (once each) the workers that exited; the client is watched by its caller."""
        for name, p in list(self.procs.items()):
            if name != "client" and p not in dead and p.poll() is not None:
                dead.add(p)
                events("worker_died", name=name, code=p.returncode)
                warn(f"warning: {name} exited with code {p.returncode}; "
                     f"its requests fail (see logs/{name}.log)")

    def _hold(self, workload, events):
        """`testbed up`: the front door forwarded to the root namespace's loopback; the link
        schedule and faults start now; the run lasts until Ctrl-C/SIGTERM (KeyboardInterrupt,
        the normal end here), watching the workers meanwhile."""
        fd_ip, fd_port = self.rt.instance("client").ip, self.rt.frontdoor.port
        fwd = self.backend.forward("client", fd_port, self.hold.port)
        host, port = fwd.address
        start_at = self._start_client() if self.hold.load else time.time()
        self.meta["client_start_at"] = start_at
        self.meta["forward"] = {"listen": f"{host}:{port}", "target": f"{fd_ip}:{fd_port}"}
        info = {"url": f"http://{host}:{port}", "frontdoor_url": loadgen.url(self.rt),
                "model": self.rt.frontdoor.model, "run_dir": str(self.dir),
                "trace": str(loadrun.write_trace(self.dir, workload,
                                                 self.deployment.scale)),
                "started_at": start_at, "load": len(workload) if self.hold.load else 0}
        self.rd.up.write_text(json.dumps(info, indent=1))
        schedule, injector = self._start_schedules(start_at, events, _warn)
        events("up", listen=f"{host}:{port}")
        if self.hold.load:
            events("client_started", requests=len(workload))
        dead, client = set(), self.procs.get("client")
        try:
            self.hold.announce(info)
            while True:
                self._check_workers(dead, events, _warn)
                if client is not None and client.poll() is not None:
                    events("client_finished", code=client.returncode)
                    print(f"load: the built-in client replayed {len(workload)} requests "
                          f"(exit {client.returncode}); still serving until Ctrl-C", flush=True)
                    client = None
                time.sleep(0.2)
        except KeyboardInterrupt:
            events("hold_ended")
        finally:
            self._stop_schedules(schedule, injector)
        self.meta["forward"]["connections"] = fwd.connections
        self.meta["dead_workers"] = sorted(n for n, p in self.procs.items() if p in dead)


def _warn(msg):
    print(msg, file=sys.stderr, flush=True)


def execute(path, overrides=(), out=None, probe=True, cli=False, progress=True, hold=None,
            metrics_port=None):     # the live exporter's port on 127.0.0.1 (testbed/live/)
    """Run every variant of an experiment file; returns (top run dir, list of summaries).
    With `hold` (`testbed up`): the one run, no load generator, until Ctrl-C/SIGTERM.
    Every run is compiled once (`deploy.compile`, the cross-field check), before any starts."""
    if hold is not None:
        overrides = [*overrides, "workload.client=none", "workload.command=null"]
    runs, deployments = zip(*deploy.load(path, overrides))
    _check_runs(runs, path, hold, out)
    for exp, dep in zip(runs, deployments):
        preflight(exp.backend, dep)
    top = pathlib.Path(out) if out else default_out(runs[0].name)
    made = ownership.missing_ancestors(top)
    top.mkdir(parents=True, exist_ok=True)
    summaries, probes = [], LinkProbes(probe)   # each distinct WAN probed once, in its first run
    shared = Shared(runs)       # scale.time auto: one pilot for the experiment's runs
    try:
        with serve.watching(top, metrics_port):     # the exporter, until the figures are made
            for exp, dep in zip(runs, deployments):
                run_dir = run_path(top, exp, len(runs))
                summaries.append(_replicate(exp, run_dir, _runner(
                    exp, dep, run_dir, shared, cli=cli, progress=progress, hold=hold,
                    probes=probes)))
            if shared.pilot is not None:        # what scale.time auto's pilot cost
                print(autojudge.pilot_line(top), flush=True)
            if len(runs) > 1:
                analysis.write_sweep(top, summaries)
                plot_load.write_table(top)
                if any(exp.replicates > 1 for exp in runs):
                    replicates.write(top, summaries)
                if any(exp.faults for exp in runs):
                    write_matrix(top, runs, summaries)
            plot.run_figures(top)
    finally:    # also on Ctrl-C and errors: what sudo made belongs to the user who ran it
        ownership.hand_back(top)
        ownership.hand_back(*made[1:], recursive=False)
    return top, summaries


def run_path(top, exp, n_runs):
    """top (a lone run), top/<label> (a safe name: config.validate), top/<label>/r<i>."""
    d = top if n_runs == 1 else top / exp.label
    return d / f"r{exp.replicate}" if exp.replicates > 1 and n_runs > 1 else d


def _runner(exp, dep, run_dir, shared=None, **kw):
    """The `execute` of one run: in virtual time on backend sim (no network, no processes),
    else the emulation's `Run` (`scale.time: auto`: after the experiment's pilot, `shared`:
    testbed/autoscale.py, testbed/autoshare.py)."""
    if exp.backend.kind == "sim":
        return SimRun(exp, run_dir, deployment=dep).execute
    if exp.scale.time == AUTO:
        return AutoRun(exp, run_dir, Run, shared=shared, **kw).execute
    return Run(exp, run_dir, deployment=dep, **kw).execute


def _replicate(exp, run_dir, execute):
    """A replicate among several that fails is recorded (the tables exclude it with a warning)
    and the others run; a lone run's failure, and Ctrl-C, stop the experiment."""
    try:
        return execute()
    except Exception as e:      # not KeyboardInterrupt: that stops every run
        if exp.replicates == 1 or isinstance(e, RunInterrupted):
            raise
        why = f"{type(e).__name__}: {e}"
        _warn(f"replicate {exp.replicate} (seed {exp.seed}) of {exp.label} failed: {why}")
        return {"label": exp.label, "policy": exp.scheduler.policy, "seed": exp.seed,
                "replicate": exp.replicate, "run_dir": str(run_dir), "error": why}


def _check_runs(runs, path, hold, out):
    """What `run` and `up` refuse before anything is made (ConfigError, PrivilegeError)."""
    if hold is not None and len(runs) > 1:
        raise ConfigError(f"testbed up holds one deployment; this file expands to {len(runs)} "
                          "runs (variants/sweep): pick one with --set", path=str(path))
    if hold is not None and runs[0].scale.time == AUTO:
        raise ConfigError("testbed up serves clients of its own; scale.time auto needs the "
                          "workload's run to choose: give a number", path=str(path),
                          key="scale.time")
    if hold is None and any(exp.workload.client == "none" for exp in runs):
        raise ConfigError("client none (no load generator) is what `testbed up` runs; "
                          "`testbed run` needs a client", path=str(path), key="workload.client")
    if out:
        rundir.check_out(out)
    if any(exp.backend.kind == "mininet" for exp in runs) and os.geteuid() != 0:
        raise PrivilegeError("testbed run builds network namespaces and needs root: use sudo")
    for exp in runs:
        if exp.backend.kind == "sim":
            why = sim.unsupported(exp) or (hold is not None and "testbed up serves real "
                                           "clients; the simulator runs in virtual time")
            if why:
                raise ConfigError(f"backend sim: {why}", path=str(path), key="backend.kind")
