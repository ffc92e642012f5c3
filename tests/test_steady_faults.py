"""The steady link faults on paper: checked keys, netem's reorder arithmetic, the probe's
count of packets sent ahead."""

import pytest

from testbed.errors import ConfigError
from testbed.net.linkmodel import check_params, needs_checksums, needs_per_frame_packets
from testbed.net.probe import _reorder_share
from testbed.net.proberoles import _early


def test_keys_are_checked_and_kept():
    lk = check_params({"rate": 1e9, "corrupt": "1%", "duplicate": 0.002, "reorder_prob": "5%",
                       "reorder_gap": 3}, "kv")
    assert (lk.corrupt, lk.duplicate, lk.reorder_prob, lk.reorder_gap) == (0.01, 0.002, 0.05, 3)
    assert lk.changed("kv", corrupt=0.0).corrupt == 0.0
    assert needs_checksums({"kv": lk}) and needs_per_frame_packets({"kv": lk})
    for bad in ({"corrupt": 1.5}, {"duplicate": -0.1}, {"reorder_gap": 0}, {"reorder_gap": 2.5}):
        with pytest.raises(ConfigError):
            check_params({"rate": 1e9, **bad}, "kv")


def test_reorder_share_is_one_per_cycle_of_gap_minus_one_plus_one_over_p():
    assert _reorder_share(0.01, 1) == 0.01
    assert _reorder_share(0.5, 3) == pytest.approx(1 / (2 + 2))
    assert _reorder_share(0.0, 5) == 0.0


def test_early_counts_the_packets_sent_ahead_not_those_left_behind():
    assert _early([0, 1, 2, 3]) == 0
    assert _early([0, 3, 1, 2, 4]) == 1          # 3 jumped ahead of 1 and 2
    assert _early([2, 0, 1, 5, 3, 4, 3]) == 2    # 2 and 5; the repeated 3 is a duplicate
