"""Routing policies and failover decisions (no root)."""

import random

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


def scan(r, remote, uncached, cost=None):
    """`Router.route_to` as a scan of every instance (the code before workers/pools.py)."""
    first, second = (r.remote, r.local) if remote else (r.local, r.remote)
    up = [i for i in first if not i.down] or [i for i in second if not i.down]
    if remote and r.max_local is not None and uncached > r.max_local and \
            not any(not i.down for i in r.remote) and r.remote:
        up = r.remote
    if not up:
        return "no prefill"
    p = min(up, key=lambda i: (cost(i) if cost else i.outstanding_s, i.name))
    decoders = [d for d in r.decode if not d.down]
    if not decoders:
        return "no decode"
    return p.name, min(decoders, key=lambda i: (i.inflight, i.name)).name


def test_the_index_picks_what_a_scan_picks():
    """Random books (ties in load, instances down and up, lists edited as the role planner
    and the replay edit them): the indexed router and a scan choose the same instances."""
    rng = random.Random(7)
    insts = [Instance(f"{dc[0]}p{k}", "prefill", dc, "h20", "a") for dc in ("prfaas", "local")
             for k in range(6)] + [Instance(f"ld{k}", "decode", "local", "h20", "d")
                                   for k in range(6)]
    r = Router("prfaas", 1000, insts, lambda i, l: l / 1000, max_local=4000)
    for step in range(20_000):
        i = rng.choice(insts)
        what = rng.random()
        if what < 0.4:
            i.outstanding_s = rng.choice([0.0, 0.5, 1.0, rng.random()])
        elif what < 0.75:
            i.inflight = rng.randint(0, 3)
        elif what < 0.9:
            i.down = rng.random() < 0.4
        elif what < 0.95 and i in r.local and len(r.local) > 1:
            r.local.remove(i)
            r.decode.append(i)
        elif what < 0.97 and i in r.decode and i.dc == "local" and len(r.decode) > 1:
            r.decode.remove(i)
            r.local.append(i)
        elif what < 0.98:
            r.set_book(r.book(step, 0.0, 10))
        remote, uncached = rng.random() < 0.5, rng.choice([10, 3000, 9000])
        cost = (lambda x: x.inflight % 2) if rng.random() < 0.2 else None
        want = scan(r, remote, uncached, cost)
        try:
            _, p, d = r.route_to(remote, uncached, cost)
            got = (p.name, d.name)
        except LookupError as e:
            got = "no prefill" if "prefill" in str(e) else "no decode"
        assert got == want, step
