"""The run folder and the run's set-up: decided once, by rank 0, and broadcast; created, locked and released.

`decide_run` is the one place a run's set-up is decided, before anything is created (a run that fails validation
leaves no folder). Upstream semantics: `--model_dir DIR` naming an existing run (it holds config.yaml) resumes it,
and its config.yaml wins over --hypes_yaml; otherwise a new run goes to DIR (created) or to
<log_root>/<name>_<timestamp>. A torchrun restart without --model_dir resumes the folder the job's first attempt
created (distributed/elastic.py), by the same rule. A non-empty folder that is not a run is refused, so that no file
of someone else's is overwritten. The value it returns, `RunSetup`, is what the lock (`claim_run`), the
checkpointer and the trainer take: nothing after it reads the launcher's environment to decide the resume again.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from opencood_ddp.distributed.elastic import RUN_ID_FILE, ElasticAttempt, elastic_attempt, find_run_of, record_run_id
from opencood_ddp.errors import ConfigError
from opencood_ddp.yaml_parsers import load_parsed_hypes

CONFIG_NAME = "config.yaml"


@dataclass(frozen=True)
class RunSetup:
    """A run's set-up. run_dir: its folder (to be created when new); resume: an existing run is continued;
    hypes: loaded from hypes_source (the run's config.yaml, else --hypes_yaml) with the overrides; attempt: this
    torchrun attempt (None outside torchrun); records_run_id: a new timestamped folder remembers the torchrun job
    that made it, so that a restart finds it; notes: what the decision has to tell the user."""

    run_dir: Path
    resume: bool
    hypes: dict
    hypes_source: str
    attempt: Optional[ElasticAttempt] = None
    records_run_id: bool = False
    notes: tuple[str, ...] = ()

    @property
    def restarted_job(self) -> bool:
        """A torchrun restart (its earlier attempt may have written the run's history)."""
        return self.attempt is not None and self.attempt.restart > 0


def decide_run(options, environ: Mapping[str, str], now: Optional[time.struct_time] = None) -> RunSetup:
    """The run of `options` (engine.options.RunOptions): its folder, whether it resumes, its hypes. Rank 0 only;
    nothing is created."""
    attempt = elastic_attempt(environ)
    named = options.model_dir or find_run_of(Path(options.log_root), attempt)
    notes = []
    if attempt is not None and attempt.restart and not options.model_dir:
        notes.append(f"torchrun restart {attempt.restart} of {attempt.max_restarts}: "
                     + (f"continuing {named}" if named else "no run folder of an earlier attempt found (pass "
                        "--model_dir, or --rdzv-id to torchrun, so that restarts resume); starting anew"))
    resume = bool(named) and _named_folder_resumes(Path(named))
    if resume:
        source = str(Path(named) / CONFIG_NAME)
        if options.hypes_yaml:
            notes.append(f"{named} is an existing run: its config.yaml wins over --hypes_yaml {options.hypes_yaml} "
                         f"(upstream's rule); using {source}")
    elif options.hypes_yaml:
        source = options.hypes_yaml
    else:
        raise ConfigError("pass --hypes_yaml for a new run, or --model_dir of an existing run (with config.yaml)")
    hypes = load_parsed_hypes(source, options.overrides)
    run_dir = Path(named) if named else new_run_dir(hypes["name"], options.log_root, now)
    return RunSetup(run_dir, resume, hypes, source, attempt, records_run_id=not resume and not options.model_dir,
                    notes=tuple(notes))


def claim_run(setup: RunSetup) -> None:
    """Rank 0: create a new run's folder and hold the run's lock. The folder is looked at again under the lock:
    another job may have made it a run since it was chosen."""
    if not setup.resume:
        create_run_dir(setup.run_dir)
    lock_run_dir(setup.run_dir)  # before anything of the run is read or written
    if _named_folder_resumes(setup.run_dir) != setup.resume:
        release_run_dir(setup.run_dir)
        raise ConfigError(f"run folder {setup.run_dir} changed while this job started (another job wrote it); "
                          f"start again, or pass another --model_dir")
    if setup.records_run_id:  # timestamped: how a torchrun restart finds it again
        record_run_id(setup.run_dir, setup.attempt)


def require_writable(path: Path, purpose: str) -> None:
    """A ConfigError naming the run folder when this process cannot write into it (`purpose`: 'resume it')."""
    if not os.access(path, os.W_OK):
        raise ConfigError(f"run folder {path} is not writable; fix its permissions to {purpose}")


def _named_folder_resumes(path: Path) -> bool:
    """Whether the folder a run was pointed at (--model_dir, or a restart's) holds a run to continue; a
    ConfigError for one that must not be written (a file, someone else's files, a run we cannot write)."""
    if not path.exists():
        return False
    if not path.is_dir():
        raise ConfigError(f"--model_dir {path} is a file, not a folder; pass a run folder or a new path")
    if (path / CONFIG_NAME).is_file():
        require_writable(path, "resume it")
        return True
    # The lock and the torchrun job's id alone: a job that died at its start, before its config.yaml.
    if any(entry.name not in (LOCK_NAME, RUN_ID_FILE) for entry in path.iterdir()):
        raise ConfigError(f"--model_dir {path} is not a run (no {CONFIG_NAME}) and is not empty; pass a run folder "
                          f"to resume, or a new or empty folder for a new run")
    return False


def new_run_dir(name: str, log_root: str, now: Optional[time.struct_time] = None) -> Path:
    """<log_root>/<name>_<timestamp>, with a suffix when another run started in the same second."""
    stamp = time.strftime("%Y_%m_%d_%H_%M_%S", now or time.localtime())
    base = Path(log_root) / f"{name}_{stamp}"
    path, suffix = base, 1
    while path.exists():
        path, suffix = Path(f"{base}_{suffix}"), suffix + 1
    return path


def create_run_dir(path: Path) -> None:
    """mkdir the run folder (rank 0); an unwritable place is one ConfigError naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot create or write the run folder {path} ({exc.strerror}); choose another "
                          f"--model_dir or --log_root") from None


# ------------------------------------------------------------------------------------------------ the lock
LOCK_NAME = ".run.lock"
_HELD: dict = {}  # run folder -> open lock file of this process (closing it releases the lock)


def lock_run_dir(path: Path) -> None:
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


def release_run_dir(path: Path) -> None:
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

