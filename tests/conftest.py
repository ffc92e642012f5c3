"""Test layout (pyroute2 habit): unit tests need nothing; tests marked `root` build real
namespaces and are skipped, with the reason, when not run as root."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, tc): run `sudo make test`")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def traces_dir():
    """../shared/traces, or skip the test when it is absent."""
    if not TRACES.is_dir():
        pytest.skip(f"public traces not found at {TRACES}")
    return TRACES
