"""Quantities as users write them (no root)."""

import pytest

from testbed import units


@pytest.mark.parametrize("text,bps", [
    ("100Gbit", 100e9), ("10 Mbit/s", 10e6), ("1Gbps", 1e9), ("125MB/s", 1e9),
    ("2.5Gbit", 2.5e9), (1000, 1000.0), ("1Kibit", 1024.0), ("8kbit", 8e3)])
def test_rate(text, bps):
    assert units.rate_bps(text) == pytest.approx(bps)


@pytest.mark.parametrize("text,s", [
    ("5ms", 5e-3), ("250us", 250e-6), ("1.5s", 1.5), ("2min", 120.0), (0.01, 0.01),
    ("60s", 60.0), ("100ns", 1e-7)])
def test_duration(text, s):
    assert units.duration_s(text) == pytest.approx(s)


@pytest.mark.parametrize("text,n", [
    ("19.4K", 19400), ("128K", 128000), ("128Ki", 131072), ("19.4Ki", 19866), (1024, 1024),
    ("1M", 1_000_000), ("1Mi", 1048576), ("1k", 1000), ("512", 512)])
def test_tokens_follow_the_byte_rule(text, n):
    """K = 1000, Ki = 1024, as for bytes: the paper's 19.4K threshold is 19,400 tokens."""
    assert units.tokens(text) == n


@pytest.mark.parametrize("text,b", [("64KiB", 65536), ("1MB", 1e6), ("1500", 1500),
                                    ("190.8MiB", 190.8 * 2**20)])
def test_size(text, b):
    assert units.size_bytes(text) == pytest.approx(b)


@pytest.mark.parametrize("text,r", [("1.2/s", 1.2), ("72/min", 1.2), (3, 3.0)])
def test_per_s(text, r):
    assert units.per_s(text) == pytest.approx(r)


@pytest.mark.parametrize("text,p", [("0.1%", 0.001), (0.01, 0.01), ("1%", 0.01)])
def test_probability(text, p):
    assert units.probability(text) == pytest.approx(p)


def test_number_accepts_yaml_strings():
    assert units.number("1e-3") == pytest.approx(1e-3)


@pytest.mark.parametrize("fn,bad", [
    (units.rate_bps, "100 apples"), (units.rate_bps, "fast"), (units.duration_s, "5 parsecs"),
    (units.tokens, "3 pages"), (units.tokens, "17Mi"), (units.tokens, "1G"), (units.probability, "150%"), (units.duration_s, "-1s"),
    (units.rate_bps, True), (units.number, "nan"), (units.per_s, "3/fortnight")])
def test_bad_values_say_what_was_expected(fn, bad):
    with pytest.raises(ValueError, match="expected"):
        fn(bad)
