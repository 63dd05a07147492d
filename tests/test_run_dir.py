"""Run folder: a new timestamped folder, --model_dir new / resume / refused, nothing created before validation."""
import os
import time

import pytest

from opencood_ddp.engine.run_dir import CONFIG_NAME, RunFolder, create_run_folder, resolve_run_folder
from opencood_ddp.errors import ConfigError

NOW = time.struct_time((2024, 3, 9, 7, 5, 2, 5, 69, -1))
STAMP = "2024_03_09_07_05_02"


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_new_timestamped_folder(tmp_path):
    folder = resolve_run_folder(None, "point_pillar", str(tmp_path / "logs"), now=NOW)
    assert folder == RunFolder(tmp_path / "logs" / f"point_pillar_{STAMP}", resume=False)
    assert folder.config_path == tmp_path / "logs" / f"point_pillar_{STAMP}" / CONFIG_NAME
    assert not (tmp_path / "logs").exists()  # nothing created


def test_empty_model_dir_string_means_timestamped(tmp_path):
    folder = resolve_run_folder("", "pp", str(tmp_path), now=NOW)
    assert folder.path == tmp_path / f"pp_{STAMP}" and folder.resume is False


def test_collision_adds_a_suffix(tmp_path):
    (tmp_path / f"pp_{STAMP}").mkdir()
    assert resolve_run_folder(None, "pp", str(tmp_path), now=NOW).path == tmp_path / f"pp_{STAMP}_1"
    (tmp_path / f"pp_{STAMP}_1").mkdir()
    (tmp_path / f"pp_{STAMP}_2").write_text("a file also collides")
    folder = resolve_run_folder(None, "pp", str(tmp_path), now=NOW)
    assert folder == RunFolder(tmp_path / f"pp_{STAMP}_3", resume=False)
    assert _tree(tmp_path) == [f"pp_{STAMP}", f"pp_{STAMP}_1", f"pp_{STAMP}_2"]


def test_model_dir_nonexistent_is_a_new_run_there(tmp_path):
    target = tmp_path / "a" / "b" / "run"
    folder = resolve_run_folder(str(target), "pp", str(tmp_path / "logs"), now=NOW)
    assert folder == RunFolder(target, resume=False)
    assert _tree(tmp_path) == []


def test_model_dir_existing_run_resumes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_NAME).write_text("name: pp\n")
    (run / "net_epoch3.pth").write_bytes(b"x")
    folder = resolve_run_folder(str(run), "other_name", str(tmp_path / "logs"), now=NOW)
    assert folder == RunFolder(run, resume=True)
    assert _tree(tmp_path) == ["run", "run/config.yaml", "run/net_epoch3.pth"]


def test_model_dir_existing_empty_folder_is_a_new_run(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    assert resolve_run_folder(str(run), "pp", str(tmp_path), now=NOW) == RunFolder(run, resume=False)


def test_model_dir_non_empty_without_config_is_refused(tmp_path):
    run = tmp_path / "someone_elses"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError) as info:
        resolve_run_folder(str(run), "pp", str(tmp_path), now=NOW)
    assert str(run) in str(info.value) and "not a run" in str(info.value) and CONFIG_NAME in str(info.value)
    assert (run / "notes.txt").read_text() == "keep me"


def test_model_dir_with_config_yaml_folder_is_not_a_run(tmp_path):
    run = tmp_path / "odd"
    (run / CONFIG_NAME).mkdir(parents=True)  # config.yaml is a folder, not a file
    with pytest.raises(ConfigError, match="not a run"):
        resolve_run_folder(str(run), "pp", str(tmp_path), now=NOW)


def test_model_dir_is_a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(ConfigError) as info:
        resolve_run_folder(str(path), "pp", str(tmp_path), now=NOW)
    assert str(path) in str(info.value) and "is a file" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_model_dir_run_not_writable(tmp_path):
    run = tmp_path / "ro"
    run.mkdir()
    (run / CONFIG_NAME).write_text("name: pp\n")
    run.chmod(0o555)
    try:
        with pytest.raises(ConfigError) as info:
            resolve_run_folder(str(run), "pp", str(tmp_path), now=NOW)
        assert str(run) in str(info.value) and "not writable" in str(info.value)
    finally:
        run.chmod(0o755)


def test_create_run_folder_creates_parents_and_leaves_no_probe(tmp_path):
    folder = resolve_run_folder(None, "pp", str(tmp_path / "logs" / "deep"), now=NOW)
    assert create_run_folder(folder) is folder
    assert folder.path.is_dir()
    assert _tree(tmp_path) == ["logs", "logs/deep", f"logs/deep/pp_{STAMP}"]
    # idempotent on an existing folder
    create_run_folder(folder)
    assert list(folder.path.iterdir()) == []


def test_create_run_folder_under_a_file_is_a_config_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "run"
    with pytest.raises(ConfigError) as info:
        create_run_folder(RunFolder(target, resume=False))
    assert str(target) in str(info.value) and "--model_dir" in str(info.value)
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_create_run_folder_in_read_only_parent(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(ConfigError) as info:
            create_run_folder(RunFolder(parent / "run", resume=False))
        assert str(parent / "run") in str(info.value) and "Permission denied" in str(info.value)
    finally:
        parent.chmod(0o755)
