"""tb-delayline (testbed/net/delayline.c) as a program: warning-free, sanitizer-clean on extreme
inputs, strict about its arguments, and built into a cache only its owner can write.

None of these needs NFQUEUE: the `--simulate` modes run the loss chain and the release-time code
of live packets alone. The link itself (traffic, delay) is tests/test_link_root.py.
"""

import os
import shutil
import subprocess
import uuid

import pytest

from testbed.errors import NetworkError
from testbed.net import delayline

MAX_DELAY_US = 3_600_000_000   # delayline.c MAX_DELAY_US
CLIP_SD = 100                  # delayline.c JITTER_CLIP_SD

pytestmark = pytest.mark.skipif(not shutil.which("gcc"), reason="gcc missing (Makefile APT_PKGS)")


def _build(tmp_path, *flags):
    out = tmp_path / "tb-delayline"
    r = subprocess.run(["gcc", *delayline.DELAYLINE_CFLAGS, "-Werror", *flags, "-o", str(out),
                        str(delayline.DELAYLINE_SRC), *delayline.DELAYLINE_LIBS],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory):
    """A build with AddressSanitizer and UBSan that aborts on the first finding."""
    return _build(tmp_path_factory.mktemp("asan"), "-g", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all")


def _run(binary, *args):
    r = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "UBSAN_OPTIONS": "print_stacktrace=1"}, timeout=60)
    return r.returncode, r.stdout, r.stderr


def _fields(out):
    return {k: float(v) for k, v in (f.split("=") for f in out.split())}


def test_compiles_without_warnings(tmp_path):
    _build(tmp_path)   # -Wall -Wextra -Werror


@pytest.mark.parametrize("dist", ["normal", "pareto", "uniform"])
@pytest.mark.parametrize("reorder", [0, 1])
def test_largest_delay_and_jitter_stay_bounded(sanitized, dist, reorder):
    """One hour of delay and of jitter: no overflow (UBSan), each hold within [0, delay + 100
    jitter], FIFO never overtakes."""
    rc, out, err = _run(sanitized, "--simulate-delay", 200_000, MAX_DELAY_US, MAX_DELAY_US,
                        dist, reorder, 5)
    assert rc == 0, err
    r = _fields(out)
    assert r["packets"] == 200_000
    assert 0 <= r["min_ns"] <= r["max_ns"] <= (1 + CLIP_SD) * MAX_DELAY_US * 1000
    assert reorder or r["overtaken"] == 0


def test_release_times_follow_delay_and_jitter(sanitized):
    """Reordering allowed, 5 ms +- 1 ms normal: the holds the code computes have that mean."""
    rc, out, err = _run(sanitized, "--simulate-delay", 200_000, 5000, 1000, "normal", 1, 2)
    assert rc == 0, err
    r = _fields(out)
    assert r["mean_ns"] == pytest.approx(5e6, rel=0.01)
    assert r["overtaken"] > 0


def test_loss_chain_under_sanitizers(sanitized):
    rc, out, err = _run(sanitized, "--simulate", 1_000_000, 0.01, 0.25, 0, 1, 7)
    assert rc == 0, err
    assert 0 < _fields(out)["lost"] < 1_000_000


@pytest.mark.parametrize("args", [
    ["7", "16", str(MAX_DELAY_US + 1), "0", "normal", "0", "0", "1", "0", "1", "1"],  # delay cap
    ["7", "16", "0", "99999999999999999999999", "normal", "0", "0", "1", "0", "1", "1"],
    ["7", "16", "-1", "0", "normal", "0", "0", "1", "0", "1", "1"],
    ["7", "0", "0", "0", "normal", "0", "0", "1", "0", "1", "1"],        # empty queue
    ["7", "65537", "0", "0", "normal", "0", "0", "1", "0", "1", "1"],    # above NFQUEUE's cap
    ["65536", "16", "0", "0", "normal", "0", "0", "1", "0", "1", "1"],   # no such queue number
    ["7", "16", "0", "0", "cauchy", "0", "0", "1", "0", "1", "1"],
    ["7", "16", "0", "0", "normal", "2", "0", "1", "0", "1", "1"],
    ["7", "16", "0", "0", "normal", "0", "nan", "1", "0", "1", "1"],
    ["7", "16", "0", "0", "normal", "0", "0", "0", "0", "1", "1"],       # P_BG 0: never leaves bad
    ["7", "16", "0", "0", "normal", "0", "0", "1", "0", "1", "seed"],
    ["7", "16", "1000x", "0", "normal", "0", "0", "1", "0", "1", "1"],
    ["--simulate-delay", "10", "0", "0", "normal", "0"],                 # too few
])
def test_bad_arguments_exit_2_before_touching_nfqueue(sanitized, args):
    rc, out, err = _run(sanitized, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (rc, out, err)


# ---------------------------------------------------------------- the cached binary

@pytest.fixture
def private_dir():
    """A scratch directory inside the real cache's parent chain (root-owned, 0755 when root)."""
    base = (delayline.ROOT_CACHE if os.geteuid() == 0 else
            delayline.pathlib.Path(os.environ.get("XDG_CACHE_HOME")
                                 or delayline.pathlib.Path.home() / ".cache") / "prfaas-testbed")
    d = base / f"test-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_default_cache_is_private_and_recorded():
    binary = delayline.delayline_binary()
    if os.geteuid() == 0:
        assert binary.parent == delayline.ROOT_CACHE    # never the repository or a user's cache
    st = binary.stat()
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022
    assert not binary.parent.stat().st_mode & 0o022
    record = binary.with_name(binary.name + ".sha256").read_text().split()
    assert record[0] == "source" and binary.name.endswith(record[1][:16])
    assert record[2:] == ["binary", delayline._sha256(binary)]


def test_cache_under_a_world_writable_directory_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)
    with pytest.raises(NetworkError, match="writable by group or others"):
        delayline.delayline_binary(cache_dir=tmp_path / "cache")


def test_a_changed_binary_is_rebuilt_and_a_writable_one_refused(private_dir):
    first = delayline.delayline_binary(cache_dir=private_dir)
    good = first.read_bytes()
    with open(first, "ab") as f:
        f.write(b"tampered")
    assert delayline.delayline_binary(cache_dir=private_dir).read_bytes() == good
    os.chmod(first, 0o775)
    with pytest.raises(NetworkError, match="writable by it alone"):
        delayline.delayline_binary(cache_dir=private_dir)


def test_a_symlinked_cache_is_refused(private_dir, tmp_path):
    private_dir.mkdir(mode=0o755)
    (private_dir / "link").symlink_to(private_dir)
    with pytest.raises(NetworkError, match="not a directory"):
        delayline.delayline_binary(cache_dir=private_dir / "link")


def test_a_changed_source_compiles_anew(private_dir, tmp_path, monkeypatch):
    before = delayline.delayline_binary(cache_dir=private_dir)
    src = tmp_path / "delayline.c"
    src.write_text(delayline.DELAYLINE_SRC.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(delayline, "DELAYLINE_SRC", src)
    after = delayline.delayline_binary(cache_dir=private_dir)
    assert after != before and after.exists() and before.exists()
