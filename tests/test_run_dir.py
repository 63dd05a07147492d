"""The run's set-up, decided once (engine/run_dir.py `decide_run`, `claim_run`): one test per rule. A new run,
an existing run with and without --hypes_yaml, a torchrun restart with and without --model_dir, a folder that
changed under the lock, and the folders that must not be written. Nothing is created before the claim."""
import os
import time
from pathlib import Path

import pytest

from zoo import hypes_of

from opencood_ddp import hypes as hypes_lib
from opencood_ddp.distributed.elastic import RUN_ID_FILE
from opencood_ddp.engine.options import RunOptions
from opencood_ddp.engine.run_dir import (CONFIG_NAME, claim_run, create_run_dir, decide_run, release_run_dir)
from opencood_ddp.errors import ConfigError

NOW = time.struct_time((2024, 3, 9, 7, 5, 2, 5, 69, -1))
STAMP = "2024_03_09_07_05_02"
HYPES = Path(__file__).resolve().parents[1] / "hypes_yaml" / "toy" / "synthetic_bn.yaml"
NAME = hypes_of(HYPES)["name"]
# torchrun's variables for the second attempt of the job "job7" (the first one made the run folder)
RESTART = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7"}
FIRST_ATTEMPT = dict(RESTART, TORCHELASTIC_RESTART_COUNT="0")


def _tree(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _existing_run(folder: Path, name: str = "the_run_itself", batch: int = 4) -> Path:
    """A run as training leaves it: config.yaml (another name and batch than the hypes file, to tell them apart)."""
    folder.mkdir(parents=True)
    hypes = hypes_of(HYPES)
    hypes["name"], hypes["train_params"]["batch_size"] = name, batch
    hypes_lib.save_hypes(dict(hypes, batch_plan={"global_batch": batch}), folder / CONFIG_NAME)
    return folder


def _decide(tmp_path: Path, environ=None, **options):
    return decide_run(RunOptions(log_root=str(tmp_path / "logs"), **options), environ or {}, now=NOW)


def test_a_new_run_gets_a_timestamped_folder_and_nothing_is_created(tmp_path):
    setup = _decide(tmp_path, hypes_yaml=str(HYPES), overrides=("train_params.batch_size=6",))
    assert setup.run_dir == tmp_path / "logs" / f"{NAME}_{STAMP}" and not setup.resume
    assert setup.hypes_source == str(HYPES) and setup.hypes["train_params"]["batch_size"] == 6
    assert setup.records_run_id and setup.attempt is None and not setup.notes
    assert _tree(tmp_path) == []


def test_the_same_second_adds_a_suffix(tmp_path):
    (tmp_path / "logs" / f"{NAME}_{STAMP}").mkdir(parents=True)
    (tmp_path / "logs" / f"{NAME}_{STAMP}_1").mkdir()
    assert _decide(tmp_path, hypes_yaml=str(HYPES)).run_dir == tmp_path / "logs" / f"{NAME}_{STAMP}_2"


@pytest.mark.parametrize("exists", [False, True], ids=["new-path", "empty-folder"])
def test_a_model_dir_that_is_no_run_yet_is_a_new_run_there(tmp_path, exists):
    target = tmp_path / "mine"
    if exists:
        target.mkdir()
    setup = _decide(tmp_path, hypes_yaml=str(HYPES), model_dir=str(target))
    assert setup.run_dir == target and not setup.resume and not setup.records_run_id


def test_an_existing_run_resumes_with_its_own_config(tmp_path):
    run = _existing_run(tmp_path / "run")
    setup = _decide(tmp_path, model_dir=str(run), overrides=("train_params.epoches=9",))
    assert setup.resume and setup.run_dir == run and setup.hypes_source == str(run / CONFIG_NAME)
    assert setup.hypes["name"] == "the_run_itself" and setup.hypes["train_params"]["epoches"] == 9
    assert "batch_plan" not in setup.hypes  # what the run recorded about itself is recomputed
    assert not setup.notes


def test_an_existing_runs_config_wins_over_hypes_yaml(tmp_path):
    run = _existing_run(tmp_path / "run")
    setup = _decide(tmp_path, hypes_yaml=str(HYPES), model_dir=str(run))
    assert setup.resume and setup.hypes["name"] == "the_run_itself"
    assert setup.notes == (f"{run} is an existing run: its config.yaml wins over --hypes_yaml {HYPES} (upstream's "
                           f"rule); using {run / CONFIG_NAME}",)


def test_a_torchrun_restart_with_model_dir_resumes_it(tmp_path):
    run = _existing_run(tmp_path / "run")
    setup = _decide(tmp_path, RESTART, hypes_yaml=str(HYPES), model_dir=str(run))
    assert setup.resume and setup.run_dir == run and setup.restarted_job and setup.hypes["name"] == "the_run_itself"


def test_a_torchrun_restart_without_model_dir_resumes_the_first_attempts_folder_with_its_config(tmp_path):
    """The first attempt made a timestamped folder and recorded the job's id; the restart finds it, and that
    run's config.yaml wins over --hypes_yaml (it used to be found only after the hypes were loaded)."""
    first = _decide(tmp_path, FIRST_ATTEMPT, hypes_yaml=str(HYPES))
    claim_run(first)
    release_run_dir(first.run_dir)
    assert (first.run_dir / RUN_ID_FILE).read_text().strip() == "job7"
    hypes_lib.save_hypes(dict(first.hypes, name="written_by_attempt_0"), first.run_dir / CONFIG_NAME)
    setup = _decide(tmp_path, RESTART, hypes_yaml=str(HYPES), overrides=("name=typed_again",))
    assert setup.run_dir == first.run_dir and setup.resume and setup.restarted_job
    assert setup.hypes_source == str(first.run_dir / CONFIG_NAME) and setup.hypes["name"] == "typed_again"
    assert setup.notes[0] == f"torchrun restart 1 of 3: continuing {first.run_dir}"


def test_a_torchrun_restart_that_finds_no_folder_starts_anew_and_says_why(tmp_path):
    setup = _decide(tmp_path, RESTART, hypes_yaml=str(HYPES))
    assert not setup.resume and setup.records_run_id and "no run folder of an earlier attempt found" in setup.notes[0]


def test_a_folder_that_became_a_run_under_the_lock_is_refused(tmp_path):
    setup = _decide(tmp_path, hypes_yaml=str(HYPES), model_dir=str(tmp_path / "race"))
    _existing_run(tmp_path / "race", name="another_job")  # another job got there between the decision and the claim
    with pytest.raises(ConfigError, match="changed while this job started"):
        claim_run(setup)
    assert not (tmp_path / "race" / ".run.lock").exists()  # the lock was given back


def test_claiming_a_new_run_creates_and_locks_it(tmp_path):
    setup = _decide(tmp_path, hypes_yaml=str(HYPES), model_dir=str(tmp_path / "a" / "b"))
    claim_run(setup)
    try:
        assert (tmp_path / "a" / "b" / ".run.lock").is_file()
    finally:
        release_run_dir(setup.run_dir)
    assert _tree(tmp_path / "a") == ["b"]


def test_no_hypes_and_no_run_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="pass --hypes_yaml for a new run, or --model_dir of an existing run"):
        _decide(tmp_path, model_dir=str(tmp_path / "nothing"))


@pytest.mark.parametrize("make, message", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), r"is not a run \(no config.yaml\) and is not empty"),
    (lambda p: (p.mkdir(), (p / CONFIG_NAME).mkdir()), r"is not a run \(no config.yaml\) and is not empty"),
    (lambda p: p.write_text("a file"), "is a file, not a folder"),
], ids=["someone-elses-files", "config-yaml-is-a-folder", "a-file"])
def test_folders_that_must_not_be_written_are_refused(tmp_path, make, message):
    target = tmp_path / "target"
    make(target)
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match=message):
        _decide(tmp_path, hypes_yaml=str(HYPES), model_dir=str(target))
    assert _tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits (as root, test_bad_inputs' "
                    "unwritable-run rows prove the refusal in a process without CAP_DAC_OVERRIDE)")
def test_a_run_that_is_not_writable_is_refused(tmp_path):
    run = _existing_run(tmp_path / "ro")
    run.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            _decide(tmp_path, model_dir=str(run))
    finally:
        run.chmod(0o755)


def test_create_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create or write the run folder"):
        create_run_dir(tmp_path / "file" / "run")
