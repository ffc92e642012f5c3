"""Routing policies and failover decisions (no root)."""

from workers.policy import Instance, Router


def cluster():
    return [Instance("rp0", "prefill", "prfaas", "h200", "a"),
            Instance("rp1", "prefill", "prfaas", "h200", "b"),
            Instance("lp0", "prefill", "local", "h20", "c"),
            Instance("ld0", "decode", "local", "h20", "d", "d:1"),
            Instance("ld1", "decode", "local", "h20", "e", "e:1")]


def router(policy="prfaas", max_local=None):
    return Router(policy, 1000, cluster(), lambda i, l: l / 1000, max_local=max_local)


def test_threshold_on_uncached_length():
    r = router()
    assert r.route(1001)[0] == "remote" and r.route(1000)[0] == "local"
    assert router("naive").route(10)[0] == "remote"
    assert router("homogeneous").route(10**6)[0] == "local"


def test_least_outstanding_work_and_fewest_in_flight():
    r = router()
    r.remote[0].outstanding_s = 5.0
    r.decode[0].inflight = 3
    kind, p, d = r.route(5000)
    assert (p.name, d.name) == ("rp1", "ld1")


def test_failover_to_local_when_prfaas_is_down():
    r = router()
    for i in r.remote:
        i.down = True
    assert r.route(50_000)[1].name == "lp0"


def test_failover_keeps_long_requests_for_prfaas():
    r = router(max_local=32_000)
    for i in r.remote:
        i.down = True
    assert r.route(20_000)[1].name == "lp0"
    assert r.route(50_000)[1].dc == "prfaas"       # waits for PrfaaS rather than block local


def test_nothing_up_is_an_error():
    r = router("homogeneous")
    r.local[0].down = True
    for i in r.remote:
        i.down = True
    try:
        r.route(10)
    except LookupError as e:
        assert "no prefill instance" in str(e)
    else:
        raise AssertionError("expected LookupError")
