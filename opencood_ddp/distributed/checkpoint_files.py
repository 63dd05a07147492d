"""Checkpoints: OpenCOOD-compatible weights plus a training-state sidecar, written atomically by rank 0.

- `net_epoch{N}.pth`: a bare state_dict of the unwrapped model (no `module.` prefix), loadable by upstream.
- `net_epoch_bestval_at{N}.pth`: the weights with the lowest all-reduced validation loss (one file).
- `net_step{K}.pth` + `training_state_step{K}.pt`: a mid-epoch checkpoint after K optimizer steps, written when
  a run stops early (SIGTERM/SIGINT, --max_steps, a non-finite loss under --on_nonfinite stop). Only the newest
  is kept, and an epoch checkpoint written after it replaces it.
- `training_state_epoch{N}.pt`: optimizer, lr scheduler, AMP scaler, epoch, global step, RNG states, the
  BatchPlan, and the size and SHA-256 of the weights file it belongs to. Its name does not match upstream's
  `*epoch*.pth` glob, so upstream tools ignore it.

Every file goes to a temporary name, is fsynced and renamed over the target: a crash at any moment leaves the
old file or the new one. A file truncated anyway (a full disk, a copy cut short) fails to load or to match the
digest in its sidecar: `CorruptCheckpointError`, and resume falls back to the previous checkpoint.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from opencood_ddp.atomic import atomic_write
from opencood_ddp.errors import CheckpointError, first_line

WEIGHTS_RE = re.compile(r"^net_epoch(\d+)\.pth$")
BESTVAL_RE = re.compile(r"^net_epoch_bestval_at(\d+)\.pth$")
STATE_RE = re.compile(r"^training_state_epoch(\d+)\.pt$")
STEP_WEIGHTS_RE = re.compile(r"^net_step(\d+)\.pth$")
STEP_STATE_RE = re.compile(r"^training_state_step(\d+)\.pt$")
UNFINISHED_RE = re.compile(r"^\..+\.tmp$")  # atomic_write's temporary files, left behind by a killed save
STATE_FORMAT = 1


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that is truncated, unreadable, or not the file its sidecar describes."""

    def __init__(self, problem: str, fix: str = "delete it to resume from an earlier checkpoint"):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem  # without the fix, for a message that lists several files


class ForeignCheckpointError(CheckpointError):
    """A state dict whose keys or shapes are another model's."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem


def weights_name(epoch: int) -> str:
    return f"net_epoch{epoch}.pth"


def step_weights_name(step: int) -> str:
    return f"net_step{step}.pth"


def bestval_name(epoch: int) -> str:
    return f"net_epoch_bestval_at{epoch}.pth"


def state_name(epoch: int) -> str:
    return f"training_state_epoch{epoch}.pt"


def step_state_name(step: int) -> str:
    return f"training_state_step{step}.pt"


def unwrap(model: nn.Module) -> nn.Module:
    """model_without_ddp: the module whose state_dict has no `module.` prefix."""
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`.

    A crash at any point leaves either the old file or the new one, never a truncated one.
    """
    atomic_write(path, lambda handle: torch.save(obj, handle))


def read_bytes(path: Path) -> bytes:
    """A checkpoint file's bytes; a missing file is one CheckpointError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check --model_dir / --epoch")
    return path.read_bytes()


def load_file(path: Path, data: Optional[bytes] = None) -> Any:
    """torch.load on CPU of the file (or of `data`, its bytes already read), turning a missing or truncated file
    into one CheckpointError naming it."""
    data = read_bytes(path) if data is None else data
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
        raise CorruptCheckpointError(f"checkpoint {path} is truncated or corrupt ({first_line(exc)})") from None


def strip_module_prefix(state_dict: Mapping[str, Any]) -> dict:
    """Accept weights saved from a DDP/DataParallel wrapper as well as bare ones."""
    if state_dict and all(key.startswith("module.") for key in state_dict):
        return {key[len("module."):]: value for key, value in state_dict.items()}
    return dict(state_dict)


def _shape(value: Any) -> Optional[tuple]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def describe_mismatch(model_state: Mapping[str, Any], loaded: Mapping[str, Any], limit: int = 5) -> str:
    """Human-readable difference between two state dicts; empty when they match in keys and shapes."""
    missing = [k for k in model_state if k not in loaded]
    unexpected = [k for k in loaded if k not in model_state]
    mismatched = [f"{k}: checkpoint {list(_shape(loaded[k]) or ())} vs model {list(_shape(model_state[k]) or ())}"
                  for k in model_state if k in loaded and _shape(loaded[k]) != _shape(model_state[k])]
    parts = []
    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
        if items:
            shown = ", ".join(items[:limit]) + (f", ... (+{len(items) - limit})" if len(items) > limit else "")
            parts.append(f"{len(items)} {label} ({shown})")
    return "; ".join(parts)


def load_weights(model: nn.Module, source: Path | Mapping[str, Any], strict: bool = True,
                 label: Optional[str] = None, allow_new: bool = False) -> list[str]:
    """Load a state dict (file or mapping) into the unwrapped model, prefix-agnostic and strict by default;
    `label` names a mapping's file in errors. `allow_new`: the model may hold entries the checkpoint lacks (a
    module added for fine-tuning, such as a compressor); they keep their initial values and their names are
    returned. Anything else that differs (an unexpected entry, another shape) is still refused."""
    label = str(source) if isinstance(source, (str, Path)) else (label or "the given state dict")
    state = load_file(Path(source)) if isinstance(source, (str, Path)) else source
    if not isinstance(state, Mapping):
        raise CheckpointError(f"checkpoint {label} holds a {type(state).__name__}, not a state_dict; "
                              f"pass a net_epoch<N>.pth file")
    state = strip_module_prefix(state)
    target = unwrap(model)
    model_state = target.state_dict()
    new = [key for key in model_state if key not in state] if allow_new else []
    report = describe_mismatch({k: v for k, v in model_state.items() if k not in new}, state)
    if report and strict:
        raise ForeignCheckpointError(f"checkpoint {label} does not match the model: {report}",
                                     "check that model.core_method and model.args match the run that saved it")
    target.load_state_dict(state, strict=strict and not new)
    return new


def epochs_on_disk(run_dir: Path, pattern: re.Pattern = WEIGHTS_RE) -> list[int]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for m in (pattern.match(p.name) for p in run_dir.iterdir()) if m)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _serialized(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _describe_bytes(name: str, data: bytes) -> dict:
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _save_pair(weights_path: Path, state_path: Path, model: nn.Module, training_state: Optional[dict],
               **state_fields: Any) -> None:
    """The sidecar first, holding the weights' size and digest, then the weights: a weights file on disk always
    has its training state next to it, and a weights file that is not the one saved is recognised."""
    weights = _serialized(unwrap(model).state_dict())
    if training_state is not None:
        atomic_save(dict(training_state, format=STATE_FORMAT, weights=_describe_bytes(weights_path.name, weights),
                         **state_fields), state_path)
    try:
        atomic_write(weights_path, lambda handle: handle.write(weights))
    except BaseException:
        if training_state is not None:  # no sidecar without its weights (a full disk): no orphan is left
            state_path.unlink(missing_ok=True)
        raise


def save_epoch(run_dir: Path, epoch: int, model: nn.Module, training_state: Optional[dict],
               keep_states: int = 2) -> Path:
    """Write net_epoch{epoch}.pth and its sidecar; keeps the newest `keep_states` sidecars and drops the
    mid-epoch checkpoints this one supersedes. Rank 0 only."""
    run_dir = Path(run_dir)
    weights = run_dir / weights_name(epoch)
    _save_pair(weights, run_dir / state_name(epoch), model, training_state, epoch=epoch)
    for old in epochs_on_disk(run_dir, STATE_RE)[:-keep_states]:
        (run_dir / state_name(old)).unlink(missing_ok=True)
    if training_state is not None and "global_step" in training_state:
        remove_step_checkpoints(run_dir, up_to=training_state["global_step"])
    return weights


def save_step(run_dir: Path, step: int, model: nn.Module, training_state: Optional[dict],
              epoch: int, step_in_epoch: int) -> Path:
    """Write net_step{step}.pth and training_state_step{step}.pt: `epoch` epochs done plus `step_in_epoch`
    steps of the next one. Older mid-epoch checkpoints are removed once this one is on disk. Rank 0 only."""
    run_dir = Path(run_dir)
    weights = run_dir / step_weights_name(step)
    _save_pair(weights, run_dir / step_state_name(step), model, training_state, epoch=epoch,
               step_in_epoch=step_in_epoch)
    remove_step_checkpoints(run_dir, up_to=step - 1)
    return weights


def remove_step_checkpoints(run_dir: Path, up_to: int) -> None:
    for pattern, name in ((STEP_WEIGHTS_RE, step_weights_name), (STEP_STATE_RE, step_state_name)):
        for step in epochs_on_disk(run_dir, pattern):
            if step <= up_to:
                (Path(run_dir) / name(step)).unlink(missing_ok=True)


def save_bestval(run_dir: Path, epoch: int, model: nn.Module) -> Path:
    """Replace the single net_epoch_bestval_at{N}.pth with this epoch's weights. Rank 0 only."""
    run_dir = Path(run_dir)
    path = run_dir / bestval_name(epoch)
    atomic_save(unwrap(model).state_dict(), path)
    for old in epochs_on_disk(run_dir, BESTVAL_RE):
        if old != epoch:
            (run_dir / bestval_name(old)).unlink(missing_ok=True)
    return path


def remove_unfinished_saves(run_dir: Path) -> list[str]:
    """Delete the temporary files of saves that were killed before their rename. Rank 0, before training."""
    removed = [p.name for p in Path(run_dir).iterdir() if UNFINISHED_RE.match(p.name) and p.is_file()]
    for name in removed:
        (Path(run_dir) / name).unlink(missing_ok=True)
    return removed


# ------------------------------------------------------------------------------------------------ resume
@dataclass(frozen=True)
class SavedCheckpoint:
    """A weights file a run can resume from, with the sidecar it should have."""

    kind: str  # "epoch" or "step"
    number: int  # the epoch, or the global step
    weights: Path
    state: Path

    def describe(self) -> str:
        return f"{self.weights.name} ({'epoch ' if self.kind == 'epoch' else 'step '}{self.number})"


def saved_checkpoints(run_dir: Path, steps_per_epoch: int) -> list[SavedCheckpoint]:
    """Resumable checkpoints of a run, newest first. A mid-epoch checkpoint after step K counts as newer than an
    epoch checkpoint N when K > N x steps_per_epoch (an epoch save removes the mid-epoch ones before it)."""
    run_dir = Path(run_dir)
    found = [SavedCheckpoint("epoch", n, run_dir / weights_name(n), run_dir / state_name(n))
             for n in epochs_on_disk(run_dir)]
    found += [SavedCheckpoint("step", k, run_dir / step_weights_name(k), run_dir / step_state_name(k))
              for k in epochs_on_disk(run_dir, STEP_WEIGHTS_RE)]
    return sorted(found, key=lambda c: (c.number * steps_per_epoch if c.kind == "epoch" else c.number,
                                        c.kind == "epoch"), reverse=True)


def verify_weights_file(path: Path, data: bytes, state: Mapping[str, Any]) -> None:
    """The weights file (its bytes, `data`) must be the one the sidecar describes (size and SHA-256), when the
    sidecar says."""
    expected = state.get("weights")
    if not expected:
        return
    if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CorruptCheckpointError(
            f"checkpoint {path} is truncated or corrupt: {len(data)} bytes that do not match the "
            f"{expected['bytes']}-byte file its training state recorded")


def load_saved(saved: SavedCheckpoint) -> tuple[dict, Optional[dict]]:
    """(weights state_dict, training state or None) of a checkpoint, verified against each other."""
    state = load_state_file(saved.state) if saved.state.exists() else None
    if state is None and saved.kind == "step":
        raise CorruptCheckpointError(f"checkpoint {saved.weights} has no {saved.state.name} beside it")
    data = read_bytes(saved.weights)  # read once: loaded and hashed from memory
    weights = load_file(saved.weights, data)
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"checkpoint {saved.weights} holds a {type(weights).__name__}, not a state_dict; "
                              f"pass a net_epoch<N>.pth file")
    if state is not None:
        try:
            verify_weights_file(saved.weights, data, state)
        except CorruptCheckpointError as exc:
            exc.weights = dict(weights)  # readable, but not the file saved: the caller may say what it is
            raise
    return dict(weights), state


def load_state_file(path: Path) -> dict:
    state = load_file(path)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CorruptCheckpointError(f"training state {path} has an unknown format",
                                     "delete it to resume from the weights alone")
    return state


def load_training_state(run_dir: Path, epoch: int) -> Optional[dict]:
    """The sidecar of `epoch`, or None when the run came from upstream (weights only)."""
    path = Path(run_dir) / state_name(epoch)
    return load_state_file(path) if path.exists() else None
