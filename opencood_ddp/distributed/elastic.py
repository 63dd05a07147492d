"""torchrun's elastic restarts: which attempt this is, and the run folder of the first attempt.

Under `torchrun --max-restarts=R`, a failed worker makes the agent stop every worker and start them all again
with the same arguments and TORCHELASTIC_RESTART_COUNT + 1. With --model_dir the restart finds its run folder
by itself; without it, the first attempt's folder (named by a timestamp) is found again through the
TORCHELASTIC_RUN_ID it recorded. torchrun's run id is a fresh uuid with --standalone and the --rdzv-id value
otherwise; the default id 'none' is shared by unrelated jobs, so it is never recorded or matched.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

RUN_ID_FILE = ".torchelastic_run_id"


@dataclass(frozen=True)
class ElasticAttempt:
    run_id: Optional[str]  # None when torchrun's id is the shared default 'none'
    restart: int  # 0 for the first attempt
    max_restarts: int


def elastic_attempt(environ: Mapping[str, str]) -> Optional[ElasticAttempt]:
    """The torchrun attempt this process belongs to; None outside torchrun."""
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    run_id = environ.get("TORCHELASTIC_RUN_ID") or None
    return ElasticAttempt(run_id=None if run_id == "none" else run_id,
                          restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                          max_restarts=int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))


def record_run_id(run_dir: Path, attempt: Optional[ElasticAttempt]) -> None:
    """Rank 0, in a new run folder: remember the torchrun job that owns it."""
    if attempt is not None and attempt.run_id is not None:
        (Path(run_dir) / RUN_ID_FILE).write_text(attempt.run_id + "\n")


def find_run_of(log_root: Path, attempt: Optional[ElasticAttempt]) -> Optional[Path]:
    """The run folder under `log_root` that an earlier attempt of this torchrun job created, if any."""
    if attempt is None or attempt.restart == 0 or attempt.run_id is None or not Path(log_root).is_dir():
        return None
    for marker in sorted(Path(log_root).glob(f"*/{RUN_ID_FILE}")):
        if marker.read_text().strip() == attempt.run_id:
            return marker.parent
    return None
