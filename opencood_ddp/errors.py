"""User-facing errors: each carries one line that names the file or key at fault and the fix.

Entry points catch `OpencoodDdpError`, print its message once (rank 0) and exit non-zero; every other
exception is a bug and keeps its traceback.
"""
import sys
from typing import Callable


class OpencoodDdpError(Exception):
    """A bad input or an impossible request, explained in one line."""

    exit_code = 2
    label = "error"  # the word before the message on rank 0's stderr


class ConfigError(OpencoodDdpError):
    """Hypes YAML or command-line flags are malformed, missing or contradictory."""


class DataError(OpencoodDdpError):
    """A dataset folder, frame or file cannot be read as OPV2V."""


class CheckpointError(OpencoodDdpError):
    """A checkpoint or run folder is missing, truncated or belongs to another model."""


class OutputError(OpencoodDdpError):
    """A result file cannot be written: a full disk, its folder's permissions, a folder in its place."""

    @classmethod
    def of(cls, exc: OSError, what: str) -> "OutputError":
        """The error of an OSError raised while writing ``what`` (eval.yaml, a frame's npy file, a picture)."""
        path = getattr(exc, "filename2", None) or getattr(exc, "filename", None)  # a rename's target, else the file
        where = f" {path}" if path else ""
        return cls(f"cannot write {what}{where} ({exc.strerror or first_line(exc)}); free space, fix the "
                   f"permissions or move what is in its place, then evaluate again")


class CollectiveError(OpencoodDdpError):
    """A collective failed because a peer process died or stalled past --dist_timeout."""

    exit_code = 4


class NonFiniteError(OpencoodDdpError):
    """A non-finite loss or gradient under --on_nonfinite stop."""

    exit_code = 3


class Interrupted(OpencoodDdpError):
    """Ctrl-C where no stop is handled at a step boundary (an evaluation, a tool), or a second Ctrl-C in training:
    the process leaves at once. Exit code 130, the shell's for SIGINT."""

    exit_code = 130
    label = "stopped"


class StopRequested(OpencoodDdpError):
    """SIGTERM/SIGINT: the run stopped at a step boundary and saved a resumable checkpoint.

    Exit code 75 is sysexits' EX_TEMPFAIL: nothing is wrong, run the same command with --model_dir again."""

    exit_code = 75
    label = "stopped"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text (library errors append paragraphs), else its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def unwrap_worker_error(exc: OpencoodDdpError) -> OpencoodDdpError:
    """The same error without the DataLoader's wrapping: an error raised in a loader worker comes back to the
    main process as 'Caught DataError in DataLoader worker process 0. Original Traceback ...' and ends with the
    original 'module.DataError: message' line, which is the one line worth showing."""
    text = str(exc)
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return exc
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return type(exc)(last[len(prefix):] if last.startswith(prefix) else last)


def run_tool(action: Callable[[], str]) -> int:
    """A single-process tool's main: print what `action` returns and exit 0, or print a project error as one
    `error:` line on stderr and exit with its code."""
    try:
        print(action())
    except OpencoodDdpError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0
