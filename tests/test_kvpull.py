"""A profile's `kv_transfer: pull` (workers/kvpull.py): the KV leaves the prefill worker only
after the prefill has ended and the pull's wait has passed; `stream` sends it during the
prefill. Measured on loopback at the receiver (`kvwire.serve`'s first-byte times against the
prefill's end in the reply), no root; and the keys' validation (exit 2, one line)."""

import asyncio
import logging
import socket

import pytest
import yaml

from conftest import SMALL_EXPERIMENT
from testbed import cli, config, deploy
from testbed import profile as profiles
from testbed.errors import ConfigError
from testbed.proto import testbed_pb2 as pb
from workers import kvpull, kvwire
from workers.engine_profile import ProfilePrefillEngine
from workers.prefill import PrefillService

LOG = logging.getLogger("test")
LATENCY = "300ms"           # real engine seconds; scale.time 10 -> 30 ms of the run's clock


def _experiment(tmp_path, **keys):
    doc = yaml.safe_load((profiles.PROFILE_DIR / "kimi-linear-1t.yaml").read_text())
    doc.update(keys)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(doc))
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT.replace("name: t", "name: t\nmodel: {profile: mine.yaml}"))
    return p


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefill_once(tmp_path, **keys):
    """(reply, receiver's [(t_first, t_last, bytes)] per frame, pull wait seconds)."""
    (exp,) = config.load_experiment(_experiment(tmp_path, **keys))
    rt = deploy.compile(exp).runtime
    eng = ProfilePrefillEngine(rt, rt.instance("rp0"))
    frames = []

    async def main():
        port = _port()
        server = await kvwire.serve("127.0.0.1", port, lambda rid, seq, flags, data, t0, t1:
                                    frames.append((t0, t1, len(data))), LOG.warning)
        svc = PrefillService(rt, "rp0", eng, LOG)
        await svc.pool.warm([("127.0.0.1", port)], 5.0)
        req = pb.PrefillRequest(request=pb.Request(id=7, input_len=1024, output_len=16),
                                decode_kv_addr=f"127.0.0.1:{port}")
        reply = await asyncio.wait_for(svc.Prefill(req, None), 20)
        for _ in range(200):                    # the kernel acks before the receiver reads
            if sum(n for *_, n in frames) >= reply.kv_bytes:
                break
            await asyncio.sleep(0.01)
        svc.close()
        server.close()
        return reply
    reply = asyncio.run(main())
    assert reply.status == "ok" and sum(n for *_, n in frames) == reply.kv_bytes > 0
    return reply, frames, eng


def test_a_pulled_kv_arrives_only_after_the_prefill_ended_and_the_pull_wait(tmp_path):
    reply, frames, eng = _prefill_once(tmp_path, kv_transfer="pull",
                                       kv_pull_latency=LATENCY)
    assert eng.pull_latency_s == pytest.approx(0.03)
    first = min(t0 for t0, _, _ in frames)
    assert first >= reply.end + 0.03 - 2e-3, (first - reply.end)
    assert reply.send_start >= reply.end and reply.overlap_s == 0


def test_a_streamed_kv_arrives_while_the_prefill_computes(tmp_path):
    reply, frames, eng = _prefill_once(tmp_path)
    assert eng.pull_latency_s is None
    first = min(t0 for t0, _, _ in frames)
    assert first < reply.end and reply.overlap_s > 0


def test_the_pull_wait_is_the_connections_measured_round_trip():
    """On loopback the kernel's RTT is microseconds: the wait is the latency plus that."""
    async def main():
        port = _port()
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
        pool = kvwire.SenderPool()
        await pool.warm([("127.0.0.1", port)], 5.0)
        async with pool.connection("127.0.0.1", port) as conn:
            rtt = kvpull.link_rtt_s(conn.sock)
            waited = await kvpull.wait_pull(conn, 0.01)
        pool.close()
        server.close()
        return rtt, waited
    rtt, waited = asyncio.run(main())
    assert 0 < rtt < 0.005 and waited == pytest.approx(0.01 + rtt)


@pytest.mark.parametrize("keys, key", [
    ({"kv_transfer": "push"}, "kv_transfer"),
    ({"kv_transfer": "pull", "kv_pull_latency": "soon"}, "kv_pull_latency"),
    ({"kv_transfer": "pull", "kv_pull_latency": "-5ms"}, "kv_pull_latency"),
    ({"kv_transfer": "pull", "kv_pull_latency": "2min"}, "kv_pull_latency"),
    ({"kv_pull_latency": "5ms"}, "kv_pull_latency"),
])
def test_bad_transfer_keys_are_refused_with_one_line(tmp_path, capsys, keys, key):
    p = _experiment(tmp_path, **keys)
    with pytest.raises(ConfigError):
        profiles.load(str(tmp_path / "mine.yaml"))
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err


def test_a_pull_profile_loads_its_keys(tmp_path):
    _experiment(tmp_path, kv_transfer="pull", kv_pull_latency="25ms")
    prof = profiles.load(str(tmp_path / "mine.yaml"))
    assert prof.kv_transfer == "pull" and prof.kv_pull_latency_s == pytest.approx(0.025)
    assert profiles.load("kimi-linear-1t").kv_transfer == "stream"
