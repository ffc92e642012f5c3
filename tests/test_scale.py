"""Scale: every scaled quantity round-trips, and a run directory gives back the scale it used."""

import json
import math

import pytest

from testbed.records import RunDir
from testbed.scale import Scale

SCALES = [Scale(), Scale(time=10, bytes=1e-3), Scale(time=40, bytes=2.5e-4, tokens=8),
          Scale(time=0.5, bytes=1.0)]
PAIRS = [("emulated_s", "real_s"), ("emulated_bytes", "real_bytes"),
         ("emulated_rate", "real_rate"), ("emulated_per_s", "real_per_s")]


@pytest.mark.parametrize("s", SCALES)
@pytest.mark.parametrize("to_emul,to_real", PAIRS)
def test_round_trip(s, to_emul, to_real):
    for x in (0.0, 1e-6, 3.7, 19.4e3, 100e9):
        assert math.isclose(getattr(s, to_real)(getattr(s, to_emul)(x)), x, rel_tol=1e-12)


def test_directions_preserve_transfer_to_compute_ratio():
    """A real-world transfer of B bytes at R bit/s takes as many emulated compute-times as it
    does real ones: (B x bytes) / (R x bytes x time) == (B / R) / time."""
    s = Scale(time=40, bytes=2.5e-4)
    b_bits, r = 8 * 5e9, 100e9
    assert math.isclose(s.emulated_bytes(b_bits) / s.emulated_rate(r), s.emulated_s(b_bits / r))
    assert math.isclose(s.real_ms(0.25), 0.25 * 40 * 1e3)


def test_rejects_non_positive():
    for bad in (0, -1, float("nan"), True, "2"):
        with pytest.raises(ValueError):
            Scale(time=bad)


def test_from_run_dir_and_summary(tmp_path):
    (tmp_path / "runtime.json").write_text(json.dumps({"scale": {"time": 10, "bytes": 1e-3,
                                                                 "tokens": 1}}))
    rd = RunDir(tmp_path)
    assert Scale.load(rd.runtime, rd.metadata) == Scale(time=10, bytes=1e-3)
    assert Scale.from_dict({"scale_time": 40, "scale_bytes": 2.5e-4}) == Scale(40, 2.5e-4)
    with pytest.raises(FileNotFoundError):
        Scale.load(RunDir(tmp_path / "missing").runtime)
