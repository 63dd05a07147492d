"""Checkpoints: OpenCOOD-compatible weights plus a training-state sidecar, written atomically by rank 0.

- `net_epoch{N}.pth`: a bare state_dict of the unwrapped model (no `module.` prefix), loadable by upstream.
- `net_epoch_bestval_at{N}.pth`: the weights with the lowest all-reduced validation loss (one file).
- `net_step{K}.pth` + `training_state_step{K}.pt`: a mid-epoch checkpoint after K optimizer steps, written when
  a run stops early (SIGTERM/SIGINT, --max_steps, a non-finite loss under --on_nonfinite stop). Only the newest
  is kept, and an epoch checkpoint written after it replaces it.
- `training_state_epoch{N}.pt`: optimizer, lr scheduler, AMP scaler, epoch, global step, RNG states, the
  BatchPlan, and the size and SHA-256 of the weights file it belongs to. Its name does not match upstream's
  `*epoch*.pth` glob, so upstream tools ignore it.

Weights are written with CPU tensors whatever device trained them, so that upstream's `torch.load` without
`map_location` opens them on a host without a GPU. Every file is read with torch's safe unpickler
(`weights_only=True`): tensors, numbers, strings and containers, never an object whose unpickling runs code. The
sidecar holds only such values (the RNG states as tensors and tuples); sidecars of format 1 (numpy's RNG state as a
numpy array) are read with numpy's array reconstruction allowed and nothing else. A file that holds anything more is
refused (`UnsafeCheckpointError`) before a byte of it is unpickled as an object.

Every file goes to a temporary name, is fsynced and renamed over the target: a crash at any moment leaves the
old file or the new one. A file truncated anyway (a full disk, a copy cut short) fails to load or to match the
digest in its sidecar: `CorruptCheckpointError`, and resume falls back to the previous checkpoint.
"""
from __future__ import annotations

import functools
import hashlib
import io
import pickle
import random
import re
from collections import OrderedDict
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
STATE_FORMAT = 2  # 2: RNG states as tensors and tuples (safe unpickler); 1: numpy's as a numpy array
READABLE_STATE_FORMATS = (1, 2)
# Keys under which forks save the model's state_dict inside a dict of their own ({'model': ..., 'epoch': ...})
WRAPPED_STATE_KEYS = ("model", "state_dict", "model_state_dict", "net")


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file that is truncated, unreadable, or not the file its sidecar describes."""

    def __init__(self, problem: str, fix: str = "delete it to resume from an earlier checkpoint"):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem  # without the fix, for a message that lists several files


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickle names objects that would run code when loaded (not tensors and containers)."""


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
        raise CheckpointError(f"checkpoint {path} does not exist; check the run folder and the checkpoint chosen "
                              f"(the tools' --model_dir, --epoch, --step)")
    return path.read_bytes()


@functools.cache
def _old_sidecar_globals() -> tuple:
    """What a format-1 sidecar needs beyond tensors: numpy's array reconstruction, under numpy 2's module name and
    numpy 1's (the same function). It builds an array from a shape, a dtype and raw bytes, and any object the
    array holds still passes through the safe unpickler."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    # numpy 2 sets a dtype's state on an instance of its own class: MT19937's key is uint32
    return (_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"),
            (_reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype, type(np.dtype(np.uint32)))


def load_file(path: Path, data: Optional[bytes] = None) -> Any:
    """torch.load on CPU of the file (or of `data`, its bytes already read) with torch's safe unpickler; a missing
    or truncated file is one CheckpointError naming it, a file that would run code an UnsafeCheckpointError."""
    data = read_bytes(path) if data is None else data
    try:
        with torch.serialization.safe_globals(list(_old_sidecar_globals())):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        names = _refused_globals(data)
        if names or "Unsupported global" in str(exc):  # else an opcode it cannot read: a torn or foreign file
            raise UnsafeCheckpointError(_unsafe_message(path, names)) from None
        raise CorruptCheckpointError(f"checkpoint {path} is truncated or corrupt ({first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001  the safe unpickler runs none of the file's code: what it raises on
        # garbage (RuntimeError, EOFError, IndexError from a torn pickle, ...) says the file is malformed
        raise CorruptCheckpointError(f"checkpoint {path} is truncated or corrupt ({first_line(exc)})") from None


def _refused_globals(data: bytes) -> list[str]:
    """The names a file's pickle would import that the safe unpickler refuses ([] when torch cannot list them:
    not its zip format, or a torn file)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001  listing reads the pickle's opcodes without running them; any failure: unknown
        return []
    allowed = {name for *_, name in (g if isinstance(g, tuple) else (f"{g.__module__}.{g.__name__}",)
                                     for g in _old_sidecar_globals())}
    return [name for name in names if name not in allowed]


def _unsafe_message(path: Path, names: list[str]) -> str:
    return (f"checkpoint {path} holds {', '.join(names) or 'a Python object'}, which loading would run as code; "
            f"weights and training state need only tensors and containers, so it was refused unread. If you trust "
            f"its source, convert it once: python tools/convert_checkpoint.py --trust {path} <new.pth>")


def as_state_dict(loaded: Any, label: str) -> Mapping[str, Any]:
    """The model's state_dict of a loaded weights file: the file itself (ours, upstream's, HEAL's), or the entry
    of a fork's dict that holds it (`{'model': state_dict, 'epoch': ...}`)."""
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"checkpoint {label} holds a {type(loaded).__name__}, not a state_dict; "
                              f"pass a net_epoch<N>.pth file")
    if all(isinstance(value, torch.Tensor) for value in loaded.values()):
        return loaded
    for key in WRAPPED_STATE_KEYS:
        inner = loaded.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return inner
    raise CheckpointError(f"checkpoint {label} holds a dict ({', '.join(map(str, list(loaded)[:6]))}) that is not a "
                          f"state_dict and has none under {', '.join(WRAPPED_STATE_KEYS)}; pass a net_epoch<N>.pth "
                          f"file")


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors live (the CPU for a model without any)."""
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def cpu_state_dict(model: nn.Module) -> "OrderedDict[str, Any]":
    """The unwrapped model's state_dict with every tensor on the CPU (a CPU tensor is kept as it is, so a CPU run's
    file is unchanged), and torch's per-module version metadata kept."""
    state = unwrap(model).state_dict()
    moved = OrderedDict((key, value.detach().cpu() if isinstance(value, torch.Tensor) else value)
                        for key, value in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        moved._metadata = metadata
    return moved


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
    try:
        loaded = load_file(Path(source)) if isinstance(source, (str, Path)) else source
    except CorruptCheckpointError as exc:  # a file named to evaluate or export: resuming is not the way out
        raise CorruptCheckpointError(exc.problem, "restore it, or take another checkpoint of the run") from None
    state = strip_module_prefix(as_state_dict(loaded, label))
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


def rng_state(device: torch.device | str = "cpu") -> dict:
    """This process's generators in a form the safe unpickler reads: torch's CPU state, numpy's and Python's,
    and the CUDA generator of this rank's own device only (another node may show other GPUs, or one)."""
    kind, key, position, has_gauss, gaussian = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gaussian": float(gaussian)}}
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
    """Restore what rng_state saved, on this rank's device. A run saved on GPUs resumes on the CPU without its
    CUDA generator, and one saved on the CPU leaves the GPU's as seeded."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_state(state["numpy"]))
    random.setstate(_python_state(state["python"]))
    generator = cuda_generator_state(state, torch.device(device))
    if generator is not None:
        torch.cuda.set_rng_state(generator, torch.device(device))


def numpy_state(saved: Any) -> tuple:
    """np.random.set_state's tuple from the saved form: format 2's dict, or format 1's tuple as numpy gave it."""
    if isinstance(saved, Mapping):
        key = saved["key"].numpy().astype(np.uint32)
        return saved["kind"], key, saved["position"], saved["has_gauss"], saved["gaussian"]
    return tuple(saved)


def _python_state(saved: Any) -> tuple:
    version, internal, gauss = saved  # the safe unpickler gives back the tuples torch.save wrote
    return version, tuple(internal), gauss


def cuda_generator_state(state: Mapping[str, Any], device: torch.device) -> Optional[torch.Tensor]:
    """The CUDA generator state to restore on `device`, or None: format 2 saves the rank's own device's; format 1
    saved one per GPU the node showed, of which this rank's is the one at its device index when the node shows
    that many (else none: a node of another size)."""
    saved = state.get("cuda")
    if device.type != "cuda" or saved is None:
        return None
    if isinstance(saved, torch.Tensor):
        return saved
    index = device.index or 0
    return saved[index] if index < len(saved) else None


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
    weights = _serialized(cpu_state_dict(model))
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
    atomic_save(cpu_state_dict(model), path)
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
    weights = as_state_dict(load_file(saved.weights, data), str(saved.weights))
    if state is not None:
        try:
            verify_weights_file(saved.weights, data, state)
        except CorruptCheckpointError as exc:
            exc.weights = dict(weights)  # readable, but not the file saved: the caller may say what it is
            raise
    return dict(weights), state


def load_state_file(path: Path) -> dict:
    state = load_file(path)
    if not isinstance(state, dict) or state.get("format") not in READABLE_STATE_FORMATS:
        raise CorruptCheckpointError(f"training state {path} has an unknown format",
                                     "delete it to resume from the weights alone")
    return state


def load_training_state(run_dir: Path, epoch: int) -> Optional[dict]:
    """The sidecar of `epoch`, or None when the run came from upstream (weights only)."""
    path = Path(run_dir) / state_name(epoch)
    return load_state_file(path) if path.exists() else None
