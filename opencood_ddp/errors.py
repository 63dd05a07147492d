"""User-facing errors: each carries one line that names the file or key at fault and the fix.

Entry points catch `OpencoodDdpError`, print its message once (rank 0) and exit non-zero; every other
exception is a bug and keeps its traceback.
"""


class OpencoodDdpError(Exception):
    """A bad input or an impossible request, explained in one line."""

    exit_code = 2


class ConfigError(OpencoodDdpError):
    """Hypes YAML or command-line flags are malformed, missing or contradictory."""


class DataError(OpencoodDdpError):
    """A dataset folder, frame or file cannot be read as OPV2V."""


class CheckpointError(OpencoodDdpError):
    """A checkpoint or run folder is missing, truncated or belongs to another model."""
