"""Rank-aware output: console on rank 0 only, a log file per rank, tqdm and TensorBoard on rank 0 only.

Other ranks stay quiet on the console (their log file keeps what they saw) so a failure is told once.
builtins.print is never touched.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

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


def progress(total: int, desc: str, is_main: bool) -> tqdm:
    """A progress bar on rank 0; a disabled one (same API, no output) elsewhere."""
    return tqdm(total=total, desc=desc, disable=not is_main, dynamic_ncols=True, leave=False,
                mininterval=1.0, file=sys.stderr)


class NullWriter:
    """Stands in for SummaryWriter on ranks other than 0."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def summary_writer(run_dir: Optional[Path], is_main: bool):
    if not is_main or run_dir is None:
        return NullWriter()
    from tensorboardX import SummaryWriter  # imported lazily: it is slow and rank 0 only needs it

    return SummaryWriter(str(run_dir))
