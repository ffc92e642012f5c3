"""The link model (testbed.net.linkmodel), the delay line's arguments and the Wan's refusals;
no root, no kernel objects."""


import pytest

from testbed.errors import ConfigError
from testbed.net import delayline, linkmodel, wan
from testbed.net.linkmodel import check_params


def test_burst_is_one_ms_of_line_rate():
    assert linkmodel.htb_burst_bytes(1e9) == 125_000
    assert linkmodel.htb_burst_bytes(10e9) == 1_250_000
    # grows with the rate (HTB reaches 10 Gbit/s here only so) and never below two frames
    assert linkmodel.htb_burst_bytes(10e6) == 2 * linkmodel.FRAME_BYTES
    assert linkmodel.htb_burst_bytes(8e3) == 2 * linkmodel.FRAME_BYTES


def test_quantum_within_htb_bounds():
    assert linkmodel.htb_quantum_bytes(8e3) == linkmodel.FRAME_BYTES
    assert linkmodel.htb_quantum_bytes(100e9) == 200_000


def test_default_queue_is_one_bdp():
    # 1 Gbit/s x 40 ms RTT = 5 MB
    assert linkmodel.default_queue_bytes(1e9, 0.040) == 5_000_000
    assert linkmodel.queue_limit(None, 1e9, 0.040) == ("bfifo", 5_000_000)


def test_default_queue_floor_holds_a_tso_burst():
    assert linkmodel.default_queue_bytes(10e6, 0.0) == linkmodel.MIN_QUEUE_BYTES
    assert linkmodel.MIN_QUEUE_BYTES > 65536


def test_explicit_queue_kinds():
    assert linkmodel.queue_limit({"packets": 100}, 1e9, 0.01) == ("pfifo", 100)
    assert linkmodel.queue_limit({"bytes": 300_000}, 1e9, 0.01) == ("bfifo", 300_000)
    assert linkmodel.queue_packets({"bytes": 3 * 1514}, 1e9, 0.0) == 3
    assert linkmodel.queue_packets({"packets": 7}, 1e9, 0.0) == 7


def test_delayline_capacity_covers_the_delay():
    p = check_params({"rate": 1e9, "delay": 0.020, "jitter": 0.002})
    # 1 Gbit/s x 28 ms = 2312 frames in flight; capacity is four times that plus headroom
    assert delayline.delayline_capacity(p) >= 4 * 2312
    assert delayline.delayline_capacity(check_params({"rate": 1e6})) == 4096
    assert delayline.delayline_capacity(check_params({"rate": 100e9, "delay": 1.0})) == \
        delayline.MAX_NFQUEUE_PACKETS


def test_check_params_fills_defaults_and_parses_units():
    p = check_params({"rate": "100Mbit", "delay": "5ms", "loss": "1%"}, "kv")
    assert p.rate_bps == 100e6 and p.delay_s == pytest.approx(0.005)
    assert p.loss == pytest.approx(0.01)
    assert p.up is True and p.queue is None and p.jitter_dist == "normal"


@pytest.mark.parametrize("bad,key", [
    ({"delay": 0.001}, "network.wan.kv.rate"),
    ({"rate": "fast"}, "network.wan.kv.rate"),
    ({"rate": 1e3}, "network.wan.kv.rate"),
    ({"rate": 1e6, "loss": 2}, "network.wan.kv.loss"),
    ({"rate": 1e6, "queue": {"frames": 3}}, "network.wan.kv.queue"),
    ({"rate": 1e6, "jitter_dist": "gamma"}, "network.wan.kv.jitter_dist"),
])
def test_check_params_names_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        check_params(bad, "kv")
    assert key in str(e.value)


def test_wan_rejects_bad_directions_and_backend():
    p = check_params({"rate": 1e6})
    with pytest.raises(ConfigError):
        wan.Wan("/nonexistent", {"kv": "a"}, {"kv": p})
    with pytest.raises(ConfigError, match="backend"):
        wan.Wan("/nonexistent", {"kv": "a", "request": "b"}, {"kv": p, "request": p},
                backend="tbf")


def test_wan_takes_only_checked_links():
    """One validation path: a dict has not been through check_params, so Wan refuses it."""
    with pytest.raises(TypeError, match="check_params"):
        wan.Wan("/nonexistent", {"kv": "a", "request": "b"},
                {"kv": {"rate": 1e6}, "request": check_params({"rate": 1e6})})


def test_set_rejects_unknown_keys_before_touching_the_kernel():
    p = check_params({"rate": 1e6})
    w = wan.Wan("/nonexistent", {"kv": "a", "request": "b"}, {"kv": p, "request": p})
    with pytest.raises(ConfigError, match="bandwidth"):
        w.set(bandwidth=5)


def test_gilbert_chain_parameters():
    p_gb, p_bg = linkmodel.gilbert(0.01, 4)
    assert p_bg == 0.25
    assert p_gb / (p_gb + p_bg) == pytest.approx(0.01)   # stationary share of the bad state


@pytest.mark.parametrize("bad", [{"loss_burst": 0.5}, {"loss_burst": "many"},
                                 {"loss": 0.6, "loss_burst": 1}, {"loss": 1, "loss_burst": 4}])
def test_check_params_rejects_bad_bursts(bad):
    with pytest.raises(ConfigError, match="network.wan.kv.loss_burst"):
        check_params({"rate": 1e6, "loss": 0.01, **bad}, "kv")


def test_burst_loss_goes_to_the_delay_line_not_iptables():
    p = check_params({"rate": 1e6, "loss": 0.02, "loss_burst": 5}, "kv")
    assert linkmodel.burst_loss(p) and linkmodel.needs_delayline(p)
    assert wan.Wan._iptables_loss(p) == 0.0
    args = delayline.DelayLine._args(p)
    assert [float(x) for x in args[4:]] == pytest.approx([0.02 * 0.2 / 0.98, 0.2, 0, 1])
    plain = check_params({"rate": 1e6, "loss": 0.02}, "kv")
    assert not linkmodel.needs_delayline(plain) and wan.Wan._iptables_loss(plain) == 0.02
    assert [float(x) for x in delayline.DelayLine._args(plain)[4:]] == [0, 1, 0, 1]


def test_loss_burst_passes_through_the_experiment_config(tmp_path, small_experiment):
    """YAML -> Deployment links -> check_params: bursts are packets, not scaled."""
    from testbed import config, deploy
    base = small_experiment.replace(
        "wan: {rate: 100Gbit, delay: 5ms}",
        "wan: {rate: 100Gbit, delay: 5ms, loss: 1%, loss_burst: 4, request: {loss_burst: 2}}")
    f = tmp_path / "exp.yaml"
    f.write_text(base)
    exp = config.load_experiment(f)[0]
    links = deploy.compile(exp).links
    kv, req = links["kv"].params(), links["request"].params()
    assert kv["loss_burst"] == 4 and req["loss_burst"] == 2
    assert check_params(kv, "kv").loss_burst == 4
    assert delayline.DelayLine._args(check_params(req, "request"))[5] == "0.5"


def _simulate(*args):
    import shutil
    import subprocess
    if not shutil.which("gcc"):
        pytest.skip("gcc missing: cannot build the delay line")
    try:
        binary = delayline.delayline_binary()
    except Exception as e:   # libnetfilter-queue-dev missing
        pytest.skip(f"delay line does not build here: {e}")
    out = subprocess.run([str(binary), "--simulate", *map(str, args)], capture_output=True,
                         text=True, check=True).stdout
    return {k: int(v) for k, v in (f.split("=") for f in out.split())}


@pytest.mark.parametrize("loss,burst", [(0.01, 4), (0.05, 1.5), (0.002, 10)])
def test_delay_line_loss_chain_stationary_loss_and_burst(loss, burst):
    """The C chain itself (tb-delayline --simulate), over 20 million packets."""
    p_gb, p_bg = linkmodel.gilbert(loss, burst)
    r = _simulate(20_000_000, p_gb, p_bg, 0, 1, 7)
    # >= 4000 bursts of geometric length (CV <= 1): the lost count's relative sd is at most
    # sqrt(2 / 4000) = 2.2% and the mean burst's 1.6%, so 10% is more than 4 sigma for both
    assert r["lost"] / r["packets"] == pytest.approx(loss, rel=0.10)
    assert r["lost"] / r["bursts"] == pytest.approx(burst, rel=0.10)


def test_delay_line_loss_chain_off_drops_nothing():
    assert _simulate(100_000, 0, 1, 0, 1, 3)["lost"] == 0


def test_netem_backend_refuses_burst_loss_before_building_anything():
    p = check_params({"rate": 1e6, "loss": 0.01, "loss_burst": 3})
    w = wan.Wan("/nonexistent", {"kv": "a", "request": "b"}, {"kv": p, "request": p},
                backend="netem")
    with pytest.raises(ConfigError, match="loss_burst"):
        w.start()    # raised before the namespace is opened (it does not exist)


def test_netlink_refusal_is_a_network_error_with_the_errno():
    import errno

    from pyroute2.netlink.exceptions import NetlinkError

    from testbed.errors import NetworkError
    from testbed.net import netlink

    def refuse():
        raise NetlinkError(errno.EEXIST)
    with pytest.raises(NetworkError, match="adding htb root on x") as e:
        netlink.call("adding htb root on x", refuse)
    assert e.value.errno == errno.EEXIST
    assert netlink.call("ok", lambda a, b=0: a + b, 1, b=2) == 3
    with pytest.raises(NetworkError) as e:
        netlink.open_netns("/nonexistent/ns")
    assert e.value.errno == errno.ENOENT
