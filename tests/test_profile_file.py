"""`model.profile` takes a profile file's path (what `testbed calibrate --out` writes) as well as
a shipped profile's name: resolved against the experiment file's folder, loaded and fitted as a
shipped one, and a missing file is refused with one line naming the key."""

import shutil

from conftest import SMALL_EXPERIMENT
from testbed import cli, config, rundir
from testbed import profile as profiles


def test_a_profile_file_next_to_the_experiment_runs_as_a_shipped_profile(tmp_path):
    shutil.copy(profiles.PROFILE_DIR / "kimi-linear-1t.yaml", tmp_path / "mine.yaml")
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT.replace("name: t", "name: t\nmodel: {profile: mine.yaml}"))
    (exp,) = config.load_experiment(p)
    assert exp.model.profile == str((tmp_path / "mine.yaml").resolve())
    assert profiles.model_name(exp.model.profile) == "mine"
    out = tmp_path / "out"
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(out), "--no-progress"]) == 0
    (run,) = rundir.find_runs(out)
    assert "mine.yaml" in (run / "config.yaml").read_text()


def test_a_missing_profile_file_is_refused_with_one_line(tmp_path, capsys):
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT.replace("name: t", "name: t\nmodel: {profile: gone.yaml}"))
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.profile" in err and "gone.yaml" in err, err
    assert not (tmp_path / "o").exists()
