"""The run directory contract: every file a run writes, by name, and typed loaders for them.

A run directory is the boundary between running and analysing (Pantheon's habit): `testbed
run` writes it; `testbed analyse`, `plot` and `report` read it and nothing else, so a directory
copied to another machine, without the experiment file or its traces, is analysed the same.
The file names and record types live in `testbed.records` (light, the workers import it);
this module adds how each file is read into tables and typed objects (pandas, yaml).

What analysis needs of the configuration comes from `config.yaml`, the resolved `Experiment`
the run was made with: it is rebuilt structurally (`testbed.schema.build`), without
`config.validate`'s checks that open trace files, so nothing outside the directory is read.
The scale comes from `runtime.json` (or metadata.json, config.yaml, summary.json) through
`testbed.scale.Scale`. `load_run` gathers these into a `RunInfo`.

`metadata.json` carries `schema`, the major version of this layout (`SCHEMA`). A reader
refuses a directory written by a newer major version with one line saying so; a directory
without the key predates versioning (schema 0) and is read as before.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import pandas as pd
import yaml

from testbed.errors import ConfigError, RunDirError
from testbed.experiment import Experiment
from testbed.net.linkmodel import Link
from testbed.records import RunDir, client_finished, read_events, read_records  # noqa: F401
from testbed.scale import Scale
from testbed.schema import build

SCHEMA = 1      # major version; bump when a file's meaning changes incompatibly


# ---------------------------------------------------------------- writing (by the run)

def check_out(out):
    """`--out` must not exist yet or be an empty directory: a run never appends to old records."""
    p = pathlib.Path(out)
    if not p.exists() and not p.is_symlink():
        return
    if not p.is_dir():
        raise ConfigError("--out exists and is not a directory; give a new or empty directory",
                          path=str(out))
    try:
        n = sum(1 for _ in p.iterdir())
    except OSError as e:
        raise ConfigError(f"--out cannot be read ({e.strerror}); give a new or empty directory",
                          path=str(out)) from None
    if n:
        raise ConfigError(f"--out is not empty ({n} entries); give a new or empty directory "
                          "(a run never adds to an earlier run's records)", path=str(out))


def write_metadata(run_dir, meta: dict) -> pathlib.Path:
    """metadata.json with this layout's schema version; returns its path."""
    path = RunDir(run_dir).metadata
    path.write_text(json.dumps({"schema": SCHEMA, **meta}, indent=1, default=str))
    return path


# ---------------------------------------------------------------- reading

def _json(path) -> dict:
    try:
        obj = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunDirError(f"cannot read ({type(e).__name__})", path=str(path)) from None
    if not isinstance(obj, dict):
        raise RunDirError("expected a JSON object", path=str(path))
    return obj


def schema_major(meta: dict) -> int:
    """The major schema version a metadata mapping declares (0: written before versioning)."""
    v = meta.get("schema", 0)
    try:
        return int(str(v).split(".")[0])
    except ValueError:
        raise RunDirError(f"schema {v!r} is not a version number", key="schema") from None


def check_schema(meta: dict, path=None) -> None:
    """Refuse a run directory written by a newer major version of the layout."""
    major = schema_major(meta)
    if major > SCHEMA:
        raise RunDirError(f"run directory schema {meta['schema']} is newer than this testbed "
                          f"reads ({SCHEMA}); analyse it with a newer testbed", path=path,
                          key="schema")


def metadata(run_dir) -> dict:
    """metadata.json, schema-checked; {} when the run was killed before writing it."""
    path = RunDir(run_dir).metadata
    if not path.exists():
        return {}
    meta = _json(path)
    check_schema(meta, str(path))
    return meta


def runtime(run_dir) -> dict | None:
    """runtime.json (the workers' description, emulated units), or None before it was written."""
    path = RunDir(run_dir).runtime
    return _json(path) if path.exists() else None


def summary(run_dir) -> dict:
    """summary.json (what `analyse` wrote), after checking the directory's schema."""
    metadata(run_dir)
    return _json(RunDir(run_dir).summary)


def scale(run_dir) -> Scale:
    """The scale a run used: runtime.json, metadata.json, config.yaml, then summary.json (a
    hand-made or pre-versioning directory); Scale() when none says."""
    rd = RunDir(run_dir)
    try:
        return Scale.load(rd.runtime, rd.metadata)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunDirError(f"cannot read the run's scale ({type(e).__name__}: {e})",
                          path=str(rd.path)) from None
    if rd.config.exists():
        s = (config_mapping(rd.config) or {}).get("scale")
        if s:
            return Scale.from_dict(s)
    if rd.summary.exists():
        s = _json(rd.summary)
        return Scale.from_dict(s.get("scale") or s)
    return Scale()


# The file the run wrote (yaml.safe_dump): libyaml's safe loader where PyYAML has it, the same
# data 10x faster than the pure-Python one (analysis and figures read it a few times a run).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def config_mapping(path) -> dict:
    """config.yaml as plain data (the resolved experiment, as the run wrote it)."""
    try:
        raw = yaml.load(pathlib.Path(path).read_text(), Loader=_SAFE_LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RunDirError(f"cannot read the run's configuration ({type(e).__name__})",
                          path=str(path)) from None
    if not isinstance(raw, dict):
        raise RunDirError("expected the resolved configuration (a mapping)", path=str(path))
    return raw


def experiment(run_dir) -> Experiment:
    """The `Experiment` of config.yaml, rebuilt structurally: the run validated it when it
    started; checks that open trace or rate-trace files are not repeated, so a copied
    directory needs nothing beside it."""
    path = RunDir(run_dir).config
    try:
        return build(Experiment, config_mapping(path))
    except RunDirError:
        raise
    except ConfigError as e:
        raise RunDirError(str(e), path=str(path)) from None


def deployment(run_dir) -> dict | None:
    """deployment.json (the compiled `testbed.deploy.Deployment`, as the run wrote it), or None
    for a directory written before it existed."""
    path = RunDir(run_dir).deployment
    return _json(path) if path.exists() else None


def links(deployment: dict | None) -> dict | None:
    """direction -> the emulated `Link` the shaper ran, from deployment.json; None without."""
    if not deployment or not deployment.get("links"):
        return None
    return {d: Link(**v) for d, v in deployment["links"].items()}


def read_csv_numeric(path) -> pd.DataFrame | None:
    """A numeric CSV (timeseries.csv) as numbers, or None; a last line cut by a crash is
    dropped."""
    p = pathlib.Path(path)
    if not p.exists():
        return None
    text = p.read_text(errors="replace")
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    if len(text.splitlines()) < 2:
        return None
    ts = pd.read_csv(io.StringIO(text), on_bad_lines="skip")
    return ts.apply(pd.to_numeric, errors="coerce").dropna().reset_index(drop=True)


def timeseries(run_dir) -> pd.DataFrame | None:
    """timeseries.csv (kernel counters per WAN direction) as numbers, or None."""
    return read_csv_numeric(RunDir(run_dir).timeseries)


def workload(run_dir) -> pd.DataFrame:
    return pd.read_parquet(RunDir(run_dir).workload)


def requests(run_dir) -> pd.DataFrame:
    """requests.parquet: one row per request, real-world durations (`analyse` wrote it)."""
    return pd.read_parquet(RunDir(run_dir).requests)


def tokens(run_dir) -> pd.DataFrame:
    return pd.read_parquet(RunDir(run_dir).tokens)


def csv_table(run_dir, name) -> pd.DataFrame | None:
    """A CSV the run wrote (scheduler.csv, ...), or None when absent or empty."""
    path = RunDir(run_dir) / name
    if not path.exists() or path.stat().st_size == 0:
        return None
    return pd.read_csv(path)


# ---------------------------------------------------------------- one run, typed

@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What analysis knows of a run besides its records, all from the run directory."""

    dir: RunDir
    experiment: Experiment              # from config.yaml
    scale: Scale
    metadata: dict                      # {} for a run killed before its teardown
    runtime: dict | None                # None for a run killed before its workers started
    deployment: dict | None = None      # deployment.json; None: written before it existed

    @property
    def links(self) -> dict | None:
        """direction -> the emulated `Link` the run's shaper ran (deployment.json)."""
        return links(self.deployment)

    @property
    def label(self) -> str:
        return self.experiment.label or self.experiment.scheduler.policy

    @property
    def policy(self) -> str:
        return self.experiment.scheduler.policy

    @property
    def client_start_at(self) -> float | None:
        """Unix time (emulated timeline) of the first scheduled arrival, when recorded."""
        return self.metadata.get("client_start_at")

    @classmethod
    def of(cls, exp, run_dir=".", metadata=None, runtime=None):
        """A RunInfo for an in-memory Experiment (tests, a run about to write its directory)."""
        return cls(dir=RunDir(run_dir), experiment=exp, scale=Scale.of(exp),
                   metadata=metadata or {}, runtime=runtime)


def load_run(run_dir) -> RunInfo:
    """The RunInfo of a run directory; RunDirError (exit code 2) when it is not one a run
    wrote or its schema is newer than this testbed reads."""
    rd = RunDir(run_dir)
    for name in (RunDir.CONFIG, RunDir.WORKLOAD):
        if not (rd / name).exists():
            raise RunDirError(f"no {name}: not a run directory, or the run was killed before "
                              "it started sending", path=str(rd.path))
    meta = metadata(rd)
    return RunInfo(dir=rd, experiment=experiment(rd), scale=scale(rd), metadata=meta,
                   runtime=runtime(rd), deployment=deployment(rd))


def find_runs(top) -> list[pathlib.Path]:
    """Analysed run directories at or below `top` (those holding a summary.json), in the order
    they ran (their metadata's start time, then name): the top itself, its runs, or their
    replicates (top/<label>/r<i>)."""
    top = pathlib.Path(top)
    if (top / RunDir.SUMMARY).exists():
        return [top]
    found = [*top.glob(f"*/{RunDir.SUMMARY}"), *top.glob(f"*/r[0-9]*/{RunDir.SUMMARY}")]
    return sorted((p.parent for p in found), key=_started)


def find_recorded_runs(top) -> list[pathlib.Path]:
    """Run directories at or below `top` holding records (config.yaml + workload.parquet)."""
    top = pathlib.Path(top)
    if (top / RunDir.CONFIG).exists():
        return [top]
    found = [*top.glob(f"*/{RunDir.CONFIG}"), *top.glob(f"*/r[0-9]*/{RunDir.CONFIG}")]
    return sorted(p.parent for p in found if (p.parent / RunDir.WORKLOAD).exists())


def _started(d):
    try:
        return (float(_json(RunDir(d).metadata)["start_time"]), d.name)
    except (RunDirError, KeyError, TypeError, ValueError):
        return (float("inf"), d.name)
