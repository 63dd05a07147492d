"""The run folder: chosen and created by rank 0, broadcast to all ranks.

Upstream semantics: `--model_dir DIR` naming an existing run (it holds config.yaml) resumes it; otherwise
a new run goes to DIR (created) or to <log_root>/<name>_<timestamp>. A non-empty folder that is not a run
is refused, so that no file of someone else's is overwritten.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from opencood_ddp.distributed.elastic import RUN_ID_FILE
from opencood_ddp.errors import ConfigError

CONFIG_NAME = "config.yaml"


@dataclass(frozen=True)
class RunFolder:
    path: Path
    resume: bool

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_NAME


def require_writable(path: Path, purpose: str) -> None:
    """A ConfigError naming the run folder when this process cannot write into it (`purpose`: 'resume it')."""
    if not os.access(path, os.W_OK):
        raise ConfigError(f"run folder {path} is not writable; fix its permissions to {purpose}")


def _existing_model_dir(path: Path) -> RunFolder:
    if not path.is_dir():
        raise ConfigError(f"--model_dir {path} is a file, not a folder; pass a run folder or a new path")
    if (path / CONFIG_NAME).is_file():
        require_writable(path, "resume it")
        return RunFolder(path, resume=True)
    # The lock and the torchrun job's id alone: a job that died at its start, before its config.yaml.
    if any(entry.name not in (LOCK_NAME, RUN_ID_FILE) for entry in path.iterdir()):
        raise ConfigError(f"--model_dir {path} is not a run (no {CONFIG_NAME}) and is not empty; pass a run folder "
                          f"to resume, or a new or empty folder for a new run")
    return RunFolder(path, resume=False)


def resolve_run_folder(model_dir: Optional[str], name: str, log_root: str,
                       now: Optional[time.struct_time] = None) -> RunFolder:
    """Decide where the run lives, without creating anything (a run that fails validation leaves no folder)."""
    if model_dir:
        path = Path(model_dir)
        return _existing_model_dir(path) if path.exists() else RunFolder(path, resume=False)
    stamp = time.strftime("%Y_%m_%d_%H_%M_%S", now or time.localtime())
    base = Path(log_root) / f"{name}_{stamp}"
    path, suffix = base, 1
    while path.exists():  # two runs started in the same second
        path, suffix = Path(f"{base}_{suffix}"), suffix + 1
    return RunFolder(path, resume=False)


def create_run_folder(folder: RunFolder) -> RunFolder:
    """mkdir the folder (rank 0); an unwritable place is one ConfigError naming it."""
    try:
        folder.path.mkdir(parents=True, exist_ok=True)
        probe = folder.path / ".write_probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot create or write the run folder {folder.path} ({exc.strerror}); choose another "
                          f"--model_dir or --log_root") from None
    return folder


# ------------------------------------------------------------------------------------------------ the lock
LOCK_NAME = ".run.lock"
_HELD: dict = {}  # run folder -> open lock file of this process (closing it releases the lock)


def lock_run_folder(path: Path) -> None:
    """Hold the run folder for this job (rank 0): an exclusive flock on <run>/.run.lock. The kernel releases it
    when the process ends however it ends, so a lock left by a dead job is simply taken over; a job that ends
    normally removes the file. The file names the holder (host, pid, start) for the refusal of a second job."""
    path = Path(path)
    if path in _HELD:
        return
    lock_path = path / LOCK_NAME
    while True:
        handle = open(lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another job"
            handle.close()
            raise ConfigError(f"run folder {path} is in use by {holder} (lock {lock_path}); wait for that job to "
                              f"end, stop it, or pass another --model_dir") from None
        # The holder before us may have removed the file between our open and our flock: then we hold a lock
        # on a file nobody else will find; open the new one.
        if lock_path.exists() and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _HELD[path] = handle


def release_run_folder(path: Path) -> None:
    """Give the lock back and remove its file (removed before the lock goes, so that no job waits on it)."""
    handle = _HELD.pop(Path(path), None)
    if handle is not None:
        (Path(path) / LOCK_NAME).unlink(missing_ok=True)
        handle.close()


def remove_if_nothing_saved(path: Path) -> bool:
    """Remove a new run's folder that holds no weights (rank 0, after the run failed): a refused or failed new
    run must leave nothing behind, or its config.yaml would make the corrected command resume the old
    settings. A folder with any net_*.pth stays. Returns whether it was removed."""
    path = Path(path)
    if not path.is_dir() or any(path.glob("net_*.pth")):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True

