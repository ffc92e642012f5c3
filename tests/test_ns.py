"""testbed.net.ns: how a command is put inside a namespace (no root), and that benchmarks use the
library rather than the commands."""

import pathlib
import re

from testbed.net import ns

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ns_argv_enters_by_path_or_name():
    assert ns.ns_argv(None, ["ip", 1]) == ["ip", "1"]
    assert ns.ns_argv("tb12s", ["ip"]) == ["nsenter", "--net=/var/run/netns/tb12s", "ip"]
    assert ns.ns_argv("/proc/7/ns/net", ["ip"])[1] == "--net=/proc/7/ns/net"


def test_benchmarks_import_no_command_modules():
    for path in (ROOT / "benchmarks").glob("*.py"):
        assert not re.search(r"testbed\.commands|from testbed import commands",
                             path.read_text()), path.name
