"""`testbed plan --lengths FILE`: one length a line, anything else is one line naming the line."""

import pytest

from testbed.commands.plan import read_lengths
from testbed.errors import ConfigError


def test_reads_lengths_with_comments_and_blank_lines(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# uncached lengths\n1000\n\n2000  # a comment\n3000\n")
    d = read_lengths(f)
    assert d.mean == pytest.approx(2000) and d.min == 1000


@pytest.mark.parametrize("text, expect", [
    ("1000\n2 3\n", "line 2"),
    ("1000\n-5\n", "line 2"),
    ("nan\n", "line 1"),
    ("1e12\n", "line 1"),
    ("# nothing\n\n", "no lengths"),
])
def test_bad_lines_are_named(tmp_path, text, expect):
    f = tmp_path / "l.txt"
    f.write_text(text)
    with pytest.raises(ConfigError, match=expect):
        read_lengths(f)


def test_binary_and_missing_files(tmp_path):
    f = tmp_path / "b.bin"
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="UTF-8"):
        read_lengths(f)
    with pytest.raises(ConfigError, match="no such"):
        read_lengths(tmp_path / "missing.txt")
