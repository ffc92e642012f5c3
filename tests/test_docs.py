"""The documentation lists what the code accepts (no root)."""

import pathlib

from testbed.config import Experiment
from testbed.schema import describe

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_yaml_key_is_documented():
    doc = (ROOT / "experiments" / "README.md").read_text()
    missing = [k for k, _, _ in describe(Experiment) if f"`{k}`" not in doc]
    assert not missing, f"add to experiments/README.md (run `testbed keys`): {missing}"


def test_every_shipped_experiment_validates():
    from testbed.config import load_experiment
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        assert load_experiment(path), path
