"""The vLLM engine on loopback: two real vLLM CPU servers (a kv_producer prefill instance and
a kv_consumer decode instance, NixlConnector over UCX TCP), started once for the module
(minutes on 2 cores), driven through the testbed's own PD proxy protocol (workers/vllm_api.py).

- Greedy decode after the KV transfer is token-identical to the same decode server serving
  the prompt alone (float32, one request at a time, the reference under its own `cache_salt`
  so that it computes its KV instead of reusing the pulled blocks).
- The KV bytes the connector reports grow by layers x kv_heads x head_dim x 2 x 4 B per prompt
  token (the model writer's shape), within 2%, as the slope over several prompt lengths.
- The KV blocks the decode instance received are bitwise the blocks the prefill instance
  computed (KVDumpNixlConnector, workers/vllm_plugin/tb_kvdump.py, dumps both ends), for
  prompts of several lengths and for a prompt whose prefix the prefill instance had cached.
- `testbed calibrate --url` measures the prefill server into a profile the profile engine loads.
- Each instance computes on the CPU it was bound to (the testbed's NixlConnector undoes
  NixlConnector's pinning of the forward pass to the last core), and between requests its
  EngineCore and worker take next to no CPU (the testbed's vLLM plugin: the shared-memory
  queue readers sleep instead of spinning for 1 s after every step).
- The prefill server's KV events (zmq, `--kv-events-config`) feed the scheduler's cache view
  through the scheduler's own subscriber (workers/kvfeed.py, workers/kvsub.py): a served prompt's
  blocks are in the view as the engine reported them, a second request with its prefix is
  placed on that instance with the hit vLLM then reports, and after /reset_prefix_cache the
  view drops them.
- The launcher's stop leaves none of the server's processes (EngineCore, workers) behind.

Skipped without the vLLM venv (`make vllm`; `make test` installs it).
"""

import asyncio
import csv
import json
import os
import pathlib
import random
import time

import numpy as np
import pytest

from test_vllm_unit import _running
from testbed import cli, vllmenv, vllmrun
from testbed.ports import free_ports
from testbed import profile as profiles
from testbed.proto import testbed_pb2 as pb
from workers import policy
from workers import vllm_api as api
from workers.kvfeed import KvEventFeed
from workers.kvplace import KvPlacer
from workers import vllm_server as vs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    vllmenv.find_python() is None, reason="vLLM not installed (`make vllm`)")]

START_TIMEOUT_S = 600       # two servers starting together on 2 busy cores: 100-200 s seen
LENGTHS = (256, 768, 1280, 2048)


# outside the ephemeral range: a port found free by binding port 0 was once taken by the other
# server's engine before this one bound it (testbed/ports.py)
_free_ports = free_ports


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(prefill url, decode url, model name, model shape, servers), running for the module."""
    d = tmp_path_factory.mktemp("vllm")
    model_dir = vllmrun.ensure_default_model()     # the one the root tests' runs use too
    shape = json.loads((model_dir / "config.json").read_text())
    ports = _free_ports(6)
    dump = d / "kv"
    dump.mkdir()
    cpus = sorted(os.sched_getaffinity(0))       # each a CPU of its own, as `cpus: auto`
    events = {"prefill": dict(kv_events_port=ports[4], kv_replay_port=ports[5],
                              kv_events_topic="p0", dev_mode=True), "decode": {}}
    servers = [vs.VllmServer(vs.ServerSpec(
        python=vllmenv.find_python(), model_dir=str(model_dir), role=role, host="127.0.0.1",
        port=ports[i], side_port=ports[i + 2], max_model_len=4096, kv_cache_space_gib=1,
        kv_dump_dir=str(dump), cpus=str(cpus[-i]), **events[role]), d / f"{role}.log")
        for i, role in enumerate(("prefill", "decode"))]
    for s in servers:
        s.start()
    try:
        model = asyncio.run(_ready(servers))
        yield servers[0].spec.url, servers[1].spec.url, model, shape, servers
    finally:
        for s in servers:
            s.stop()


async def _ready(servers):
    import aiohttp  # reason: aiohttp (loaded by the workers anyway)
    async with aiohttp.ClientSession() as session:
        for s in servers:
            await s.wait_healthy(START_TIMEOUT_S, session)
        return await api.model_name(session, servers[0].spec.url)


async def _transfer(pfx, dec, model, ids, max_tokens):
    """(tokens after the transfer, colocated tokens, connector bytes of the transfer)."""
    import aiohttp  # reason: as above
    async with aiohttp.ClientSession() as session:
        before = await api.connector_bytes(session, dec)
        params = await api.prefill(session, pfx, model, ids)
        got = []
        async for chunk in api.decode_stream(session, dec, model, ids, max_tokens, params):
            got += chunk
        moved = await api.connector_bytes(session, dec) - before
        alone = await api.generate(session, dec, model, ids, max_tokens,
                                   cache_salt=f"alone-{random.random()}")
        return got, alone, moved


def test_greedy_after_transfer_is_identical_and_kv_bytes_match_the_shape(pair):
    pfx, dec, model, shape, _ = pair
    rng = random.Random(7)
    moved = {}
    for n in LENGTHS:
        ids = [rng.randrange(shape["vocab_size"] - 3) for _ in range(n)]
        got, alone, moved[n] = asyncio.run(_transfer(pfx, dec, model, ids, 12))
        assert len(got) == 12 and got == alone, (n, got, alone)
    xs, ys = list(moved), list(moved.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    want = shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2 * 4
    assert want == 4096         # the writer's default shape, float32
    assert abs(slope / want - 1) < 0.02, (slope, want, moved)


async def _pull(pfx, dec, model, ids):
    """Prefill on `pfx`, then the decode instance pulls the KV; the decode side runs under a
    fresh `cache_salt`, so it pulls every block instead of hitting its own prefix cache."""
    import aiohttp  # reason: as above
    async with aiohttp.ClientSession() as session:
        params = await api.prefill(session, pfx, model, ids)
        await api.generate(session, dec, model, ids, 2, params,
                           cache_salt=f"pull-{random.random()}")
        return params


def _dumps(dump, prefill_request_id, timeout_s=60):
    """(prefill dump, decode dump) of one transfer, each (info, blocks): the decode's is
    written when its pull lands, the prefill's when NIXL tells it the read is done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dec = [json.loads(p.read_text()) for p in dump.glob("decode-*.json")]
        dec = [i for i in dec if i["remote_request_id"] == prefill_request_id]
        pre = dump / f"prefill-{prefill_request_id}.json"
        if dec and pre.exists():
            pi = json.loads(pre.read_text())
            return ((pi, np.load(pre.with_suffix(".npy"))),
                    (dec[0], np.load(dump / f"decode-{dec[0]['request_id']}.npy")))
        time.sleep(0.2)
    raise AssertionError(f"no dump pair for {prefill_request_id} in {sorted(dump.iterdir())}")


def test_the_kv_received_is_bitwise_the_kv_computed(pair):
    """Three transfers, the third a prefix-cache hit on the prefill instance (its first 512
    tokens, 4 whole blocks of 128, are the first transfer's): for each, every block the decode
    instance received equals, bit for bit and layer by layer, the block the prefill instance
    held for it, and the hit reused the first transfer's blocks."""
    pfx, dec, model, shape, servers = pair
    dump = pathlib.Path(servers[0].spec.kv_dump_dir)
    rng = random.Random(11)
    draw = lambda n: [rng.randrange(shape["vocab_size"] - 3) for _ in range(n)]  # noqa: E731
    first = draw(1000)
    seen = {}
    for name, ids in (("1000", first), ("300", draw(300)), ("hit", first[:512] + draw(700))):
        params = asyncio.run(_pull(pfx, dec, model, ids))
        (pi, p), (di, d) = _dumps(dump, params["remote_request_id"])
        n_blocks = -(-len(ids) // pi["block_size"])
        assert pi["num_tokens"] == len(ids) and len(pi["block_ids"]) == n_blocks, (name, pi)
        assert di["remote_block_ids"] == pi["block_ids"], (name, di, pi)
        assert len(di["block_ids"]) == n_blocks and d.shape == p.shape, (name, d.shape, p.shape)
        assert pi["dtype"] == "torch.float32" and p.shape[0] == shape["num_hidden_layers"]
        assert np.abs(p).sum() > 0                      # real KV, not an empty cache
        same = [bool(np.array_equal(p[:, b].view(np.uint32), d[:, b].view(np.uint32)))
                for b in range(n_blocks)]
        assert all(same), (name, same)
        seen[name] = (pi, p)
    (a, pa), (h, ph) = seen["1000"], seen["hit"]
    assert h["block_ids"][:4] == a["block_ids"][:4], (a["block_ids"], h["block_ids"])
    assert np.array_equal(ph[:, :4], pa[:, :4])


def test_calibrate_measures_the_running_server_into_a_profile_it_runs(pair, tmp_path):
    """`testbed calibrate --url` on the module's prefill server, a short plan: the profile's
    points are the measured medians, its KV bytes per token the model's, its decode memory the
    server's KV cache (1 GiB), and it loads."""
    pfx, _, _, shape, servers = pair
    out = tmp_path / "cpu.yaml"
    assert cli.main(["calibrate", "--url", pfx, "--model", servers[0].spec.model_dir,
                     "--out", str(out), "--lengths", "64,256,512", "--batches", "1,2",
                     "--contexts", "64,256", "--steps", "8", "--budget", "60", "--repeats",
                     "1", "--max-model-len", "4096"]) == 0
    prof = profiles.load(str(out))
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    pre = {int(r["length"]): float(r["seconds"]) for r in rows
           if r["kind"] == "prefill" and r["cached"] == "0"}
    assert set(pre) == {64, 256, 512} and all(t > 0 for t in pre.values())
    got = dict(prof.prefill_points["cpu"])
    assert got.keys() == pre.keys()
    assert all(got[l] == pytest.approx(t, rel=1e-6) for l, t in pre.items())
    assert any(r["kind"] == "prefill" and int(r["cached"]) > 0 for r in rows)
    assert sum(r["kind"] == "step" for r in rows) >= 3     # medians of the step_run rows
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2 * 4
    assert prof.s_kv(1000) == pytest.approx(per_token * 1000)              # fp32
    cap = prof.decode.kv_capacity      # the server's blocks x 16 x bytes per token
    assert 0.8 * 2**30 < cap <= 2**30 and prof.decode.step_time(1, 64) > 0
    assert cli.main(["calibrate", "--url", "localhost:1", "--model",
                     servers[0].spec.model_dir, "--out", str(tmp_path / "x.yaml")]) == 2


def test_calibrate_pair_times_the_kv_pull_between_the_modules_servers(pair):
    """What `testbed calibrate --pair` measures (testbed/calibpair.py), on this module's two
    servers: per length a prefill, then the decode server's first token after pulling the KV
    (its connector reports the bytes); the fit's latency is the hand-off less one step."""
    from testbed import calibfit, calibpair, calibrun  # reason: the calibration side only

    pfx, dec, model, shape, _ = pair
    m = calibfit.Measurements()
    lengths = (64, 256, 512)

    async def main():
        import aiohttp  # reason: as above
        async with aiohttp.ClientSession() as session:
            before = await api.connector_bytes(session, dec)
            p = calibrun.Prober(session, pfx, model, shape["vocab_size"] - 3, seed=5)
            skipped = await calibpair.measure(p, dec, {"repeats": 1, "prefill_lengths":
                                                       lengths}, m, lambda _: None,
                                              time.monotonic() + 120)
            return skipped, await api.connector_bytes(session, dec) - before
    skipped, moved = asyncio.run(main())
    assert not skipped
    pulls = {s.length: s.seconds for s in m.of("pull")}
    assert set(pulls) == set(lengths) and all(0 < t < 5 for t in pulls.values())
    assert {s.length for s in m.of("prefill")} == set(lengths)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2 * 4
    assert moved >= 0.9 * per_token * sum(lengths)        # the KV was pulled, every time
    fit = calibfit.pull_fit(m, (0.0, 0.0, 0.0))
    assert 0 <= fit["latency_s"] <= max(pulls.values())


def _engine_processes(server):
    """{name: pid} of the server's EngineCore and worker processes."""
    out = {}
    for pid in vs.descendants(server.proc.pid):
        name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
        if name.startswith("VLLM::"):
            out[name] = pid
    return out


def _cpu_s(pid):
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_each_instance_computes_on_its_own_cpu(pair):
    """The worker's main thread runs the forward pass (one OpenMP thread): it stays on the CPU
    of VLLM_CPU_OMP_THREADS_BIND, where vLLM's NixlConnector would have moved it to the last."""
    *_, servers = pair
    for s in servers:
        worker = _engine_processes(s)["VLLM::Worker"]
        status = pathlib.Path(f"/proc/{worker}/task/{worker}/status").read_text()
        allowed = next(line.split()[1] for line in status.splitlines()
                       if line.startswith("Cpus_allowed_list"))
        assert allowed == s.spec.cpus, (s.spec.role, allowed)


def test_an_instance_between_requests_takes_next_to_no_cpu(pair):
    """After a request, EngineCore and its worker sleep on their queues: with vLLM's own
    readers the worker spins for 1 s after every step (measured: 0.94-0.97 of a core in the
    half second after a prefill)."""
    pfx, _, model, _, servers = pair
    procs = _engine_processes(servers[0])
    ids = random.Random(3).choices(range(100, 4000), k=512)

    async def prefill_then_idle(window_s=1.0):
        import aiohttp  # reason: as above
        async with aiohttp.ClientSession() as session:
            await api.generate(session, pfx, model, ids, 1, cache_salt="idle")
        before, t0 = {p: _cpu_s(p) for p in procs.values()}, time.monotonic()
        await asyncio.sleep(window_s)
        return sum(_cpu_s(p) - before[p] for p in procs.values()) / (time.monotonic() - t0)

    cores = asyncio.run(prefill_then_idle())
    assert cores < 0.25, f"EngineCore + worker took {cores:.2f} of a core while idle"


SEED, BLOCK = 5, 128


def _req(rid, n, prefix):
    return pb.Request(id=rid, input_len=n, prefix_blocks=prefix)


def _router():
    """p0 (the module's server, fed by its events, already busy) and p1 (an idle instance
    with nothing cached) in the local cluster; T(l) = 1 ms per token."""
    insts = [policy.Instance(name=n, role="prefill", dc="local", accelerator="cpu", addr="")
             for n in ("p0", "p1")]
    insts[0].outstanding_s = 0.1
    insts.append(policy.Instance(name="d0", role="decode", dc="local", accelerator="cpu",
                                 addr=""))
    return policy.Router("prfaas", 4096, insts, lambda i, l: l * 1e-3)


async def _served(session, pfx, dec, model, ids):
    """The PD flow on the module's pair (the decode's pull frees the prefill's blocks);
    the prefill's `cached_tokens`."""
    params, cached = await api.prefill_reply(session, pfx, model, ids)
    await api.generate(session, dec, model, ids, 1, params, cache_salt=f"s{random.random()}")
    return cached


async def _reset(session, pfx, timeout_s=60):
    """POST /reset_prefix_cache until vLLM reports success (it refuses while a request still
    holds blocks: a prefill's blocks stay until the decode's pull is acknowledged)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.post(f"{pfx}/reset_prefix_cache") as r:
            if r.status == 200 and (await r.json()).get("success"):
                return True
        await asyncio.sleep(0.5)
    return False


async def _kv_events(pfx, dec, model, model_dir, port, replay, tmp):
    import aiohttp  # reason: as above
    feed = KvEventFeed([("p0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")],
                       vllmenv.find_python(), rows_path=tmp / "kv_events.csv")
    placer = KvPlacer(_router(), feed.view, SEED, model_dir, BLOCK, lambda rec: None)
    got = {}
    async with aiohttp.ClientSession() as session:   # a batch before the subscriber joins
        await _served(session, pfx, dec, model, placer.prompt(_req(0, 200, [401])))
    await feed.start()
    got["up"] = await feed.wait_up(60)      # connected, and caught up by a replay
    _record(feed, placer.prompt(_req(4, 300, [701])))
    try:
        async with aiohttp.ClientSession() as session:
            first = _req(1, 700, [501, 502, 503, 504])      # 4 shared blocks, 5 whole vLLM blocks
            ids = placer.prompt(first)
            got["cached_first"] = await _served(session, pfx, dec, model, ids)
            t_reply = time.time()
            got["held"] = await feed.wait_until(lambda: feed.view.holds("p0", ids), 30)
            got["reply_to_view_s"] = time.time() - t_reply
            got["hits_first"] = feed.view.hit_tokens(ids, ["p0", "p1"])
            second = _req(2, 900, [501, 502, 503, 504])
            got["place_second"] = placer.place(second, time.time())
            got["cached_second"] = await _served(session, pfx, dec, model, placer.prompt(second))
            got["place_other"] = placer.place(_req(3, 900, [601, 602]), time.time())
            got["reset"] = await _reset(session, pfx)
            other = placer.prompt(_req(4, 300, [701]))      # one more step publishes the clear
            await _served(session, pfx, dec, model, other)
            got["dropped"] = await feed.wait_until(
                lambda: feed.view.holds("p0", other) and not feed.view.holds("p0", ids[:128]), 30)
            got["hits_after"] = feed.view.hit_tokens(ids, ["p0"])
    finally:
        await feed.close(tmp / "kv_events.json", requests=4)
    return got, json.loads((tmp / "kv_events.json").read_text())


def _record(feed, prompt):
    """With TESTBED_KV_EVENTS_RECORD=DIR, the live batches' payloads go to DIR (as
    tests/data/kv_events/ was recorded), with the last prompt's token ids."""
    out = os.environ.get("TESTBED_KV_EVENTS_RECORD")
    if not out:
        return
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps({"block_size": BLOCK, "prompt": prompt}))
    handle = feed.handle

    def keep(header, payload, now=None):
        if header["kind"] == "batch" and not header["replayed"]:
            (out / f"{header['seq']:06d}.bin").write_bytes(payload)
        handle(header, payload, now)
    feed.handle = keep


def test_kv_events_feed_the_view_that_places_requests(pair, tmp_path):
    """Measured on the module's prefill server: its events reach the subscriber's view, which
    then holds the prompt's whole blocks by token ids; the view's hit for a second request is
    what vLLM's own `cached_tokens` reports for it, and placement sends it to the instance
    that holds it though that instance is busier; after a reset the view drops them. The
    subscriber joined after the module's other tests: it caught up with their batches by a
    replay before it reported up."""
    pfx, dec, model, shape, servers = pair
    spec = servers[0].spec
    got, summary = asyncio.run(_kv_events(pfx, dec, model, spec.model_dir, spec.kv_events_port,
                                          spec.kv_replay_port, tmp_path))
    print("kv events:", got, json.dumps({k: summary[k] for k in (
        "batches", "events", "payload_bytes", "gap", "replay", "replayed_batches", "resync",
        "delay_s")}))
    assert got["up"] and got["held"] and got["hits_first"] == {"p0": 640, "p1": 0}
    kind, p, _, route = got["place_second"]
    assert (p.name, route["cached_len"], route["cache_source"]) == ("p0", 512, "local")
    assert got["cached_second"] == 512          # vLLM's own count: the view's hit
    assert got["place_other"][1].name == "p1" and got["place_other"][3]["cached_len"] == 0
    assert got["reset"] and got["dropped"] and got["hits_after"] == {"p0": 0}
    assert summary["source"] == "vllm_kv_events" and summary["events"]["cleared"] >= 1
    assert summary["replay"] >= 1 and summary["replayed_batches"] > 0 and summary["resync"] == 0
    assert summary["delay_s"]["n"] >= 2     # the test's own batches came live
    assert summary["instances"]["p0"]["block_size"] == BLOCK
    assert 0 <= summary["delay_s"]["p50"] < 1.0


def test_stop_leaves_no_server_process(pair):
    """Last in the module: it stops the servers the fixture started."""
    *_, servers = pair
    pids = [p for s in servers for p in s.pids()]
    assert len(pids) >= 4          # API server + EngineCore (+ its worker) each
    for s in servers:
        s.stop()
    alive = [(pid, start) for pid, start in pids if _running(pid, start)]
    assert not alive, alive
