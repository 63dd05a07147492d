"""User-facing errors: each carries one line that names the file or key at fault and the fix.

Entry points catch `OpencoodDdpError`, print its message once (rank 0) and exit non-zero; every other
exception is a bug and keeps its traceback.
"""
import sys
from typing import Callable


class OpencoodDdpError(Exception):
    """A bad input or an impossible request, explained in one line."""

    exit_code = 2


class ConfigError(OpencoodDdpError):
    """Hypes YAML or command-line flags are malformed, missing or contradictory."""


class DataError(OpencoodDdpError):
    """A dataset folder, frame or file cannot be read as OPV2V."""


class CheckpointError(OpencoodDdpError):
    """A checkpoint or run folder is missing, truncated or belongs to another model."""


def run_tool(action: Callable[[], str]) -> int:
    """A single-process tool's main: print what `action` returns and exit 0, or print a project error as one
    `error:` line on stderr and exit with its code."""
    try:
        print(action())
    except OpencoodDdpError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0
