"""Runs that the pytest processes of one session share: made by the first process that asks, read by the others.

`make test` runs two pytest processes (pytest-xdist). A module-scoped fixture is set up in every process that runs
one of its tests, so a parity run that two tests read was made twice whenever the two tests went to different
processes: 31-35 s of CPU each time, in both of two measured runs of the suite (2026-11-28).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable


def session_root(tmp_path_factory) -> Path:
    """The folder of this pytest session: under xdist each process's basetemp is <session>/popen-gwN, so their
    parent is the session's own; without xdist the parent holds other sessions' folders, so it is basetemp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> tuple[Path, object]:
    """(folder, make(folder)) with make run once per session, by whichever process asks first; the others wait on a
    file lock and get the same folder and the JSON of its result. A make that raises leaves no result, so the next
    process to ask makes it again (in a fresh folder) and reports its own failure."""
    root = session_root(tmp_path_factory)
    folder, result_file = root / name, root / f"{name}.result.json"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result_file.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            partial = result_file.with_suffix(".partial")
            partial.write_text(json.dumps(make(folder)))
            partial.replace(result_file)
        return folder, json.loads(result_file.read_text())


def process_record(result: subprocess.CompletedProcess) -> dict:
    return {"args": [str(a) for a in result.args], "returncode": result.returncode, "stdout": result.stdout,
            "stderr": result.stderr}


def completed_process(record: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(record["args"], record["returncode"], record["stdout"], record["stderr"])
