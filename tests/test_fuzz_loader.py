"""Fuzz the experiment loader with a seeded mutator (no root, a few seconds).

Seeds are every experiment in experiments/ and tests/data/. Each mutation either edits the
parsed mapping (a value replaced by something hostile, a key dropped or invented, a section
turned into a scalar) or edits the text (characters inserted or deleted, lines duplicated,
the file cut short). Whatever comes out, `load_experiment` must return valid `Experiment`s or
raise a one-line `ConfigError`, never another exception.
"""

import copy
import pathlib
import random

import pytest
import yaml

from testbed import config
from testbed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEDS = sorted((ROOT / "experiments").glob("*.yaml")) + sorted((ROOT / "tests" / "data").glob("*.yaml"))
HOSTILE = [None, True, False, "yes", "off", -1, 0, 1, 7, 0.5, -1e-300, 1e308, 2**63 - 1, -2**63,
           "", " ", "x" * 300, [], {}, [1, 2], {"a": 1}, {"at": "1s"}, [{"at": "1s", "rate": 0}],
           "1/s", "5ms", "-5s", "100Gbit", "0bit", "19.4K", "128Ki", "16Mi", "1e999", "nan",
           "NaN", "inf", "100%", "150%", "/etc/x", "..", "a/b", "\u202e", "\x07", "3:1", "012",
           "1e-3", "100p", "0p", "1TB", "64KiB", "poisson", "trace", "onoff", "torch", "netem",
           "userspace", "prfaas", "naive", "homogeneous", "lognormal", "fixed", "empirical",
           "h200", "h20", "kimi-linear-1t", "traces/wan_degrade.csv", "traces/missing.csv"]
TEXT_CHARS = list(":{}[]-#&*!|>'\"\t\n ,0.9%/~\\") + ["\u00a0", "\ufeff", "&a ", "*a", "<<: "]
ITERATIONS = 40
MOONCAKE_ITERATIONS = 8      # each load parses a 3 MB trace


def _paths(d, prefix=()):
    """Every (key path) in a nested mapping/list."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _parent(d, path):
    for k in path[:-1]:
        d = d[k]
    return d


def mutate_data(raw, rng):
    d = copy.deepcopy(raw)
    for _ in range(rng.randint(1, 3)):
        paths = _paths(d)
        if not paths:
            break
        path = rng.choice(paths)
        parent, last = _parent(d, path), path[-1]
        op = rng.random()
        if op < 0.6:
            parent[last] = copy.deepcopy(rng.choice(HOSTILE))
        elif op < 0.75 and isinstance(parent, dict):
            del parent[last]
        elif op < 0.85 and isinstance(parent, dict):
            parent[rng.choice(["bogus", "rate", "label", "name", "variants", "sweep", "queue",
                               "changes", "loss_burst", "documents"])] = rng.choice(HOSTILE)
        elif isinstance(parent, dict):
            parent[last] = {rng.choice(["a", "b.c", "scheduler.policy"]): rng.choice(HOSTILE)}
        if isinstance(d, dict) and rng.random() < 0.1:
            d["sweep"] = {".".join(map(str, rng.choice(paths))): [rng.choice(HOSTILE)]}
    return yaml.safe_dump(d, allow_unicode=True, sort_keys=False)


def mutate_text(text, rng):
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        pos = rng.randrange(len(text) + 1)
        if op < 0.35:
            text = text[:pos] + rng.choice(TEXT_CHARS) + text[pos:]
        elif op < 0.6:
            text = text[:pos] + text[pos + rng.randint(1, 8):]
        elif op < 0.8:
            lines = text.splitlines(keepends=True)
            if lines:
                i = rng.randrange(len(lines))
                lines.insert(i, lines[rng.randrange(len(lines))])
                text = "".join(lines)
        else:
            text = text[:pos]
    return text


def _check(path):
    try:
        runs = config.load_experiment(path)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) <= 400, repr(msg)
        return "error"
    assert runs and all(isinstance(r, config.Experiment) for r in runs)
    return "valid"


@pytest.mark.parametrize("seed_file", SEEDS, ids=lambda p: p.name)
def test_mutations_give_an_experiment_or_one_config_error(seed_file, tmp_path):
    (tmp_path / "traces").symlink_to(ROOT / "experiments" / "traces")
    text = seed_file.read_text()
    raw = yaml.safe_load(text)
    rng = random.Random(f"fuzz:{seed_file.name}")
    n = MOONCAKE_ITERATIONS if "trace:" in text else ITERATIONS
    outcomes = {"valid": 0, "error": 0}
    for i in range(n):
        mutated = mutate_data(raw, rng) if i % 2 == 0 else mutate_text(text, rng)
        path = tmp_path / f"m{i}.yaml"
        path.write_text(mutated)
        try:
            outcomes[_check(path)] += 1
        except AssertionError:
            raise
        except Exception as e:   # the point of the test: name the input that escaped
            pytest.fail(f"{type(e).__name__}: {e}\n--- input ---\n{mutated[:3000]}")
    assert outcomes["error"] > 0
