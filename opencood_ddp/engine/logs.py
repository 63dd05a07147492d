"""Rank-aware output: console on rank 0 only, a log file per rank, tqdm and TensorBoard on rank 0 only.

Other ranks stay quiet on the console (their log file keeps what they saw) so a failure is told once.
builtins.print is never touched.
"""
from __future__ import annotations

import csv
import io
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from opencood_ddp.atomic import atomic_write

LOGGER_NAME = "opencood_ddp"
_FORMAT = "%(asctime)s %(levelname)s [rank %(rank)d] %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_logging(rank: int, level: int = logging.INFO) -> logging.Logger:
    """Console handler on rank 0 (messages only); other ranks get none until a file is attached."""
    logger = get_logger()
    logger.handlers.clear()
    logger.filters.clear()
    logger.setLevel(level)
    logger.propagate = False
    logger.addFilter(_RankFilter(rank))
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(console)
    return logger


def attach_log_file(run_dir: Path, rank: int) -> Path:
    """Every rank logs to <run_dir>/logs/rank{rank}.log; rank 0 creates the folder before others attach."""
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    get_logger().addHandler(handler)
    return path


PLAIN_PROGRESS_INTERVAL_S = 30.0


def progress(total: int, desc: str, is_main: bool, stream=None):
    """A progress bar on rank 0 when stderr is a terminal; a plain line every 30 s when it is piped (a cluster
    job's log, `make demo > log`: tqdm's carriage-return frames would fill it); nothing on other ranks."""
    stream = stream or sys.stderr
    if is_main and not stream.isatty():
        return PlainProgress(total, desc, stream)
    return tqdm(total=total, desc=desc, disable=not is_main, dynamic_ncols=True, leave=False,
                mininterval=1.0, file=stream)


class PlainProgress:
    """tqdm's update / set_postfix / close for a piped stream: one line per interval and one at the end."""

    def __init__(self, total: int, desc: str, stream, interval_s: float = PLAIN_PROGRESS_INTERVAL_S):
        self.total, self.desc, self.stream, self.interval_s = total, desc, stream, interval_s
        self.n, self.postfix, self.closed = 0, "", False
        self.started = self.last = time.monotonic()

    def update(self, count: int = 1) -> None:
        self.n += count
        if count and time.monotonic() - self.last >= self.interval_s:
            self._line()

    def set_postfix(self, **values: object) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        if not self.closed and self.n > 0:
            self._line()
        self.closed = True

    def _line(self) -> None:
        self.last = time.monotonic()
        elapsed = self.last - self.started
        text = f"{self.desc}: {self.n}/{self.total} ({elapsed:.0f} s)" + (f" {self.postfix}" if self.postfix else "")
        print(text, file=self.stream, flush=True)


def summary_writer(run_dir: Path, purge_step: Optional[int] = None):
    """The run's TensorBoard writer (rank 0 only: engine/hooks.TensorBoardHook); `purge_step`: events of that step
    and later, from earlier files of the run, are dropped by TensorBoard (a resume)."""
    from tensorboardX import SummaryWriter  # imported lazily: it is slow and rank 0 only needs it

    return SummaryWriter(str(run_dir), purge_step=purge_step)


STEP_LOG_NAME = "train_steps.csv"


class StepLog:
    """Rank 0's `train_steps.csv`: per optimizer step the all-reduced loss parts, the lr and the timing.

    It is how two runs are compared step by step (tools/parity_check.py) and where a run's time goes
    (data_seconds is the time the step waited for the loader). Other ranks hold a disabled log.
    """

    def __init__(self, run_dir: Optional[Path], is_main: bool):
        self.path = Path(run_dir) / STEP_LOG_NAME if is_main and run_dir is not None else None
        self._columns: Optional[list[str]] = None

    def keep_until(self, step: int) -> None:
        """After a resume: drop the rows of steps past the restored checkpoint, which will be trained again."""
        if self.path is None or not self.path.is_file():
            return
        rows = read_step_log(self.path)
        if rows and rows[-1]["step"] > step:
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, list(rows[0]))
            writer.writeheader()
            writer.writerows(row for row in rows if row["step"] <= step)
            # A kill during the rewrite must not lose the rows that stay.
            atomic_write(self.path, lambda handle: handle.write(text.getvalue().encode()))

    def write(self, row: dict) -> None:
        if self.path is None:
            return
        if self._columns is None:
            existing = self._existing_columns()
            self._columns = existing or list(row)
            new = [key for key in row if existing and key not in existing]
            if new:  # a resume that logs more (--half fp16's scaler_skipped after a float32 start): widen the file
                self._columns = existing + new
                self._rewrite_with(self._columns)
            if not self.path.is_file() or self.path.stat().st_size == 0:
                with open(self.path, "w", newline="") as handle:
                    csv.DictWriter(handle, self._columns).writeheader()
        with open(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, self._columns, restval="", extrasaction="ignore").writerow(row)

    def _rewrite_with(self, columns: list[str]) -> None:
        """The file's rows under ``columns``, the new ones empty (read back as NaN), rewritten atomically."""
        with open(self.path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.path, lambda handle: handle.write(text.getvalue().encode()))

    def _existing_columns(self) -> Optional[list[str]]:
        if not self.path.is_file():
            return None
        with open(self.path, newline="") as handle:
            return next(csv.reader(handle), None)


def read_step_log(path: Path) -> list[dict]:
    """train_steps.csv as a list of rows: `step` and `epoch` as int, every other column as float."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [{key: _cell(key, value) for key, value in row.items()} for row in rows]


def _cell(key: str, value: str) -> float:
    if key in ("step", "epoch"):
        return int(value)
    return float(value) if value != "" else math.nan
