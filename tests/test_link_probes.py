"""`measure.LinkProbes`: one link probe per distinct WAN of a `testbed run` (no root).

The probe itself is root-only (tests/test_run_root.py runs it end to end); here a stand-in
counts how often the backend would have been asked to measure, from the metadata each run
describes after its build.
"""

import copy

from testbed.measure import LinkProbes, wan_key

LINK = {"rate": 1e9, "delay": 0.0, "jitter": 0.0, "loss": 0.0, "loss_burst": None,
        "queue": None, "up": True, "jitter_dist": "normal", "reorder": False}
META = {"backend": "mininet",
        "shaping": {"backend": "userspace", "reason": "netem missing",
                    "emulated": {"kv": dict(LINK), "request": dict(LINK)}},
        "tcp": {"congestion_control_kv": "bbr", "congestion_control_default": "bbr",
                "segmentation_offload": True,
                "timers": {"rto_min_ms": 5, "quickack": True, "hosts": 16,
                           "routes": ["0.0.0.0/0"]}}}


class Prober:
    """The backend's probe: a new result on every call, and how many calls there were."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"measured": {"rtt_p50_ms": 1.0 + self.calls}, "warnings": [f"w{self.calls}"]}


def meta(**changes):
    m = copy.deepcopy(META)
    for path, value in changes.items():
        *parents, last = path.split("__")
        d = m
        for p in parents:
            d = d[p]
        d[last] = value
    return m


def test_runs_with_the_same_wan_share_the_first_probe():
    probes, probe = LinkProbes(), Prober()
    first = probes.fidelity("prfaas", meta(), probe)
    # another deployment on the same WAN (more hosts: the timers' host count differs)
    second = probes.fidelity("naive", meta(tcp__timers__hosts=20), probe)
    assert probe.calls == 1
    assert first["shared"] is False and first["measured_in"] == "prfaas"
    assert second["shared"] is True and second["measured_in"] == "prfaas"
    assert second["measured"] == first["measured"] and second["warnings"] == ["w1"]
    assert second["measured_at"] == first["measured_at"]


def test_a_different_wan_is_probed_again():
    probes, probe = LinkProbes(), Prober()
    probes.fidelity("a", meta(), probe)
    faster = probes.fidelity("b", meta(shaping__emulated__kv__rate=2e9), probe)
    lossy = probes.fidelity("c", meta(tcp__segmentation_offload=False), probe)
    cubic = probes.fidelity("d", meta(tcp__congestion_control_kv="cubic"), probe)
    netem = probes.fidelity("e", meta(shaping__backend="netem"), probe)
    assert probe.calls == 5
    assert all(f["shared"] is False for f in (faster, lossy, cubic, netem))
    assert faster["measured_in"] == "b" and faster["measured"] == {"rtt_p50_ms": 3.0}
    again = probes.fidelity("f", meta(shaping__emulated__kv__rate=2e9), probe)
    assert probe.calls == 5 and again["measured_in"] == "b" and again["shared"] is True


def test_no_probe_measures_nothing():
    probes, probe = LinkProbes(enabled=False), Prober()
    assert probes.fidelity("a", meta(), probe) == {"skipped": "--no-probe"}
    assert probes.fidelity("b", meta(), probe) == {"skipped": "--no-probe"}
    assert probe.calls == 0


def test_a_backend_whose_probe_path_depends_on_placement_is_probed_every_run():
    probes, probe = LinkProbes(), Prober()
    ray = meta(backend="ray")
    assert wan_key(ray) is None
    probes.fidelity("a", ray, probe)
    second = probes.fidelity("b", ray, probe)
    assert probe.calls == 2 and second["shared"] is False and second["measured_in"] == "b"


def test_an_adopted_probe_is_shared_by_the_runs_on_its_wan():
    """`scale.time: auto`'s link check probed the pilot's network at a run's scale."""
    probes, probe = LinkProbes(), Prober()
    probes.adopt(meta(), "early", 123.0, {"measured": {"x": 1}, "warnings": ["off"]})
    # the check probed again after correcting the link's calibration: the later one describes
    # the link the runs get
    probes.adopt(meta(), "prfaas (the pilot's link check)", 456.0, {"measured": {"x": 2},
                                                                  "warnings": []})
    first = probes.fidelity("homogeneous", meta(tcp__timers__hosts=20), probe)
    assert probe.calls == 0 and first["measured"] == {"x": 2} and first["shared"] is True
    assert first["measured_in"] == "prfaas (the pilot's link check)"
    assert first["measured_at"] == 456.0 and first["warnings"] == []
    other = probes.fidelity("fast", meta(shaping__emulated__kv__rate=2e9), probe)
    assert probe.calls == 1 and other["measured_in"] == "fast" and other["shared"] is False
    probes.adopt(meta(backend="ray"), "x", 1.0, {"measured": {}, "warnings": []})
    assert probes.fidelity("r", meta(backend="ray"), probe)["shared"] is False  # placement
