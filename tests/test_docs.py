"""The documentation lists what the code accepts, and its links hold (no root).

The README is a front door of one screen or two (STYLE.md, habit 17); docs/README.md indexes
every page under docs/; every relative link in the README, experiments/README.md and docs/
points at a file that exists.
"""

import pathlib
import re

import pytest

from testbed import vllmenv
from testbed.config import Experiment, load_experiment
from testbed.errors import ConfigError
from testbed.schema import describe

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", ROOT / "experiments" / "README.md", *sorted(DOCS.glob("*.md"))]


def _relative_links(page):
    for target in LINK.findall(page.read_text()):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#", 1)[0]


def test_every_yaml_key_is_documented():
    doc = (ROOT / "experiments" / "README.md").read_text()
    missing = [k for k, _, _ in describe(Experiment) if f"`{k}`" not in doc]
    assert not missing, f"add to experiments/README.md (run `testbed keys`): {missing}"


def test_every_shipped_experiment_validates():
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        if "engine: vllm" in path.read_text() and vllmenv.find_python() is None:
            with pytest.raises(ConfigError, match="make vllm"):    # refused, saying why
                load_experiment(path)
            continue
        assert load_experiment(path), path


def test_relative_links_resolve():
    broken = [(page.relative_to(ROOT), target) for page in _pages()
              for target in _relative_links(page) if not (page.parent / target).exists()]
    assert not broken, f"links to files that do not exist: {broken}"


def test_readme_fits_a_screen_or_two():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/"


def test_docs_index_lists_every_page():
    listed = set(_relative_links(DOCS / "README.md"))
    missing = [p.name for p in sorted(DOCS.glob("*.md"))
               if p.name != "README.md" and p.name not in listed]
    assert not missing, f"add to docs/README.md: {missing}"


def test_readme_links_the_docs_index():
    assert "docs/README.md" in set(_relative_links(ROOT / "README.md"))
