"""What every worker process shares: the runtime description, readiness, logging, shutdown.

The runner writes `runtime.json` in the run directory (`testbed.runtime.WorkerRuntime`, typed,
every time emulated): the instances (name, role, datacenter, accelerator, IP, ports), the
scheduler's policy and the timing parameters. A worker loads it with `load_runtime`, starts
its servers, then writes `ready/<name>`; the runner waits for those files (bounded) instead of
sleeping. SIGTERM stops a worker cleanly (the runner sends it at the end of a run).

A worker never outlives the runner (the orchestrator), even a SIGKILLed one: the runner starts it
with a parent-death signal (`testbed.lifecycle.die_with_parent`), and `die_with_orchestrator`, called
at start-up, also watches the orchestrator named in the environment (PID and start time) from a
thread, for the cases the kernel signal does not cover.
"""

import argparse
import asyncio
import logging
import os
import select
import signal
import threading
import time

import grpc

from testbed import lifecycle
from testbed.records import RunDir
from testbed.runtime import WorkerRuntime
from workers import control, framedrpc, status

WATCH_INTERVAL_S = 0.2


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--runtime", required=True, help="path of the run's runtime.json")
    p.add_argument("--name", required=True, help="this process's instance name")
    return p.parse_args()


def load_runtime(path):
    return WorkerRuntime.load(path)


def setup_logging(name):
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
    return logging.getLogger(name)


WARM_TIMEOUT_S = 15.0     # connections opened before a worker says it is ready (runner: 30 s)


def mark_ready(rt, name):
    path = RunDir(rt.dir).ready_file(name)
    path.parent.mkdir(exist_ok=True)
    path.write_text(str(time.time()))


def die_with_orchestrator(interval_s=WATCH_INTERVAL_S):
    """Exit (SIGKILL to this process) when the orchestrator ends: at once where the kernel
    gives pidfds (`_pidfd`), else within `interval_s`.

    The orchestrator is named by `lifecycle.ORCHESTRATOR_ENV` ('<pid>:<start time>'); without it
    (a worker started by hand) nothing is watched. Returns the watching thread or None.
    """
    token = os.environ.get(lifecycle.ORCHESTRATOR_ENV)
    if not token:
        return None
    if not lifecycle.identity_alive(token):
        os.kill(os.getpid(), signal.SIGKILL)

    def watch():
        fd = _pidfd(token)
        if fd is not None:      # readable once that process has exited: no wake-up before
            select.select([fd], [], [])
        while lifecycle.identity_alive(token):
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=watch, name="orchestrator-watch", daemon=True)
    t.start()
    return t


def _pidfd(token):
    """A pidfd of the process `token` names (Linux 5.3+), or None: then the watch polls every
    `WATCH_INTERVAL_S` (five wake-ups a second in every worker, 0.2 s late at most). Opened
    before the identity is checked, so the descriptor is that process, not a reused PID's."""
    try:
        fd = os.pidfd_open(int(token.split(":")[0]))
    except (AttributeError, OSError, ValueError):
        return None
    if lifecycle.identity_alive(token):
        return fd
    os.close(fd)
    return None


def startup(description):
    """(args, runtime, this instance, logger) of a worker process."""
    die_with_orchestrator()
    args = parse_args(description)
    rt = load_runtime(args.runtime)
    return args, rt, rt.instance(args.name), setup_logging(args.name)


async def start_grpc(inst, add_servicer, service):
    """A started grpc.aio server with `service` on this instance's address."""
    server = grpc.aio.server(options=grpc_options())
    add_servicer(service, server)
    server.add_insecure_port(inst.addr)
    await server.start()
    return server


def grpc_options(scale=None):
    """Many concurrent streams on one channel; no message-size surprises for token chunks.
    Reconnect quickly after an outage (gRPC's default backoff grows to 120 s, which would
    stretch a 10 s link cut into minutes of an instance looking down): 100 ms growing to 1 s,
    real-world. Those are the emulated system's timers, so a channel of a run at `scale`
    (a testbed.scale.Scale; None: real speed) waits them on the emulated clock, as the health
    checks do (a restarted worker listening again is then reached within 1 s real-world, not
    within scale.time seconds)."""
    def backoff(ms):
        return max(1, round((scale.emulated_s(ms / 1e3) if scale else ms / 1e3) * 1e3))
    return [("grpc.max_concurrent_streams", 10000),
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", backoff(100)),
            ("grpc.min_reconnect_backoff_ms", backoff(100)),
            ("grpc.max_reconnect_backoff_ms", backoff(1000))]


async def connect_all(channels, log, timeout_s=WARM_TIMEOUT_S):
    """Open every gRPC channel before the run starts, so the first request does not pay the TCP
    and HTTP/2 handshakes (or ARP) across the WAN. Best effort: a peer still missing after
    `timeout_s` is logged and its channel keeps trying on its own."""
    async def one(name, ch):
        try:
            await asyncio.wait_for(ch.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("no connection to %s after %.0fs; going on without it", name, timeout_s)
    await asyncio.gather(*(one(n, c) for n, c in channels.items()))


async def connect_framed(channels, log, timeout_s=WARM_TIMEOUT_S):
    """Open every framed channel (workers/framedrpc.py) before the run starts, as `connect_all`
    does gRPC's, trying again while refused (a worker listens there just after its gRPC
    server); a peer not reached in `timeout_s` is logged, and its first call tries again."""
    async def one(name, ch):
        loop = asyncio.get_running_loop()
        deadline, error = loop.time() + timeout_s, "timed out"
        while loop.time() < deadline:
            try:
                await asyncio.wait_for(ch.connect(), max(0.0, deadline - loop.time()))
                return
            except asyncio.TimeoutError:
                break
            except grpc.aio.AioRpcError as e:
                error = e.details()
                await asyncio.sleep(0.05)
        log.warning("no framed connection to %s after %.0fs (%s); its first call tries again",
                    name, timeout_s, error)
    await asyncio.gather(*(one(n, c) for n, c in channels.items()))


async def run_engine_worker(description, make_service, add_servicer, method, cache_cls):
    """The life of a prefill or decode worker process (workers/prefill.py, workers/decode.py).

    Start-up; the service, its engine made (`make_service(rt, name, inst, log)`); its cache
    when the run has one (`cache_cls`, started); `service.start(inst)`: what serves beside the
    gRPC server (decode: the KV and token sockets); the gRPC server, and `method` (the
    scheduler's call, workers/framedrpc.py) on the framed port; the `slow` fault's control of
    the engine; `service.started()`: what comes once it serves (decode: the step loop;
    prefill: its KV connections); under --metrics, `status/<name>.json` rewritten from
    `service.status_sample()` (workers/status.py); ready. Then it serves until SIGTERM, and
    `service.close()` and the cache's close end it."""
    args, rt, inst, log = startup(description)
    service = make_service(rt, args.name, inst, log)
    if rt.cache.enabled:
        service.cache = await cache_cls(rt, inst, log).start()
    await service.start(inst)
    server = await start_grpc(inst, add_servicer, service)
    framed = await framedrpc.serve([(method, service)], inst.ip, inst.rpc_port, log)
    control.install(rt, args.name, service.engine, log)
    await service.started()
    status_task = status.start(rt, args.name, service.status_sample)  # noqa: F841 (held)
    mark_ready(rt, args.name)
    log.info(service.up_line(inst))

    def cleanup():
        framed.close()
        done = service.close()      # a coroutine where the engine has one to stop (vLLM)
        if service.cache is not None:
            service.cache.close()
        return done

    await serve_until_signalled(server, cleanup)


async def serve_until_signalled(server, cleanup=None):
    """Run until SIGTERM/SIGINT, then stop the gRPC server and run `cleanup`."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=0.5)
    if cleanup is not None:
        res = cleanup()
        if asyncio.iscoroutine(res):
            await res

