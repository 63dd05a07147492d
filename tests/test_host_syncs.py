"""No model's training step waits for its device: nothing in forward, loss or backward reads a device tensor back.

A GPU step whose forward reads a value back (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, ``int()``) or runs
an operator whose output's shape depends on the values (``nonzero``, boolean-mask indexing, ``masked_select``,
``unique``, ``repeat_interleave`` without ``output_size``) or checks a linear-algebra result's status
(``torch.linalg.inv`` reads its factorisation's status back) stops the host until the device has caught up, and the
launches after it are no longer hidden behind the device's work (issue 52). So does a blocking host-to-device
copy: torch sends ``x.new_tensor(values)``, ``torch.tensor(values, device=...)``, an index that is a Python list
(``x[:, [3, 2, 1]]``) and ``.to(device)`` without ``non_blocking`` from pageable memory, and waits for the device's
queue to drain first (``memcpy_and_sync``). On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` finds them (tools/gpu_check.py); here torch's ``meta`` device stands for
the GPU: its tensors have shapes and no values, so none of these can run on it, and an operation that mixes a host
tensor into the device's work fails as it would on CUDA.

Each model's toy batch goes through the task's own ``move_to`` to ``meta``, which keeps
``data/device_points.HOST_KEYS`` on the host (the models derive their indices from those there:
models/modules/cav_layout.py), and the model is moved there too. Two modes count every read-back call and every
value-shaped operator on a device tensor, with the model's line that made it: the Python-level calls (a function
mode) and the operators autograd's backward dispatches (a dispatch mode). The count must be 0. A control run with
``record_len`` moved to the device, as upstream's batches have it, shows that the counter sees such reads.

SECOND is not here: spconv has no meta kernels, and its CUDA convolutions read their output's voxel count back by
design.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import List

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from opencood_ddp.models.modules.cav_layout import device_constant
from tests.zoo import toy_batch

TOY = Path(__file__).resolve().parents[1] / "hypes_yaml" / "toy"
META = torch.device("meta")
READ_BACKS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
              "masked_select", "unique", "unique_consecutive", "argwhere"}
VALUE_SHAPED_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                    "aten::unique_consecutive", "aten::unique_dim"}
# operators that read a device tensor's values to the host: linalg.inv, solve, cholesky and the like check their
# factorisation's status there (on a GPU, V2X-ViT's warp waited for the device in one: gpu_check, 2026-11-30)
READING_OPS = {"aten::_linalg_check_errors"}


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _site() -> str:
    """The innermost frame of this package that made the call."""
    frames = [f for f in traceback.extract_stack() if "/opencood_ddp/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _has_list_index(index) -> bool:
    """Whether an index holds a Python sequence of positions (``x[[0, 2]]``, ``x[:, [3, 2, 1]]``): torch copies it
    to the device, and waits. A tuple of integers (``x[0, 1]``) is one position per dimension, no copy."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(i, (list, tuple)) for i in index)


def _blocking_upload(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a Python-level call builds a device tensor from host data with a blocking copy."""
    if name == "new_tensor":
        return _on_device(args[0])
    if name in ("tensor", "as_tensor", "asarray"):
        device = kwargs.get("device")
        return device is not None and torch.device(device).type != "cpu"
    if name in ("__getitem__", "__setitem__"):
        return _on_device(args[0]) and _has_list_index(args[1])
    return False


def _has_bool_index(index) -> bool:
    """Whether an index (one item or a sequence of them) holds a boolean mask: its result's shape needs the values."""
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _Recorder:
    """What the two modes below share: the list of what they saw, and stopping the step at the first."""

    def __init__(self):
        super().__init__()
        self.seen: List[str] = []

    def stop(self, what: str, name: str) -> None:
        self.seen.append(f"{name} at {_site()}")
        raise AssertionError(f"the step {what}: {self.seen[-1]}")


class HostReads(_Recorder, TorchFunctionMode):
    """Records each read-back call on a device tensor (its name and site) and stops the step there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        hit = name in READ_BACKS and _on_device(args[0] if args else None)
        if name == "__getitem__" and _on_device(args[0]):
            hit = _has_bool_index(args[1])
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1 \
                and _on_device(args[1]):
            hit = True
        if hit:
            self.stop("reads a device tensor back", name)
        if _blocking_upload(name, args, kwargs):
            self.stop("copies host data to the device and waits", name)
        return func(*args, **kwargs)


class ValueShapedOps(_Recorder, TorchDispatchMode):
    """Records each operator whose output shape needs the device's values, as dispatched (backward included)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        device_args = [a for a in args if _on_device(a)]
        hit = bool(device_args) and name in VALUE_SHAPED_OPS
        if name == "aten::index" and device_args:
            hit = _has_bool_index(args[1])
        if name == "aten::_to_copy" and device_args and kwargs.get("device") == torch.device("cpu"):
            hit = True
        if hit:
            self.stop("runs an operator shaped by device values", name)
        if device_args and name in READING_OPS:
            self.stop("reads a device tensor back", name)
        if _blocking_copy(name, args, kwargs):
            self.stop("copies host data to the device and waits", name)
        return func(*args, **kwargs)


def _blocking_copy(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a dispatched copy moves a host tensor (more than one number: a 0-d host tensor is a scalar to the
    kernel) to the device without ``non_blocking``."""
    if kwargs.get("non_blocking") or (name == "aten::copy_" and len(args) > 2 and args[2]):
        return False
    if name == "aten::_to_copy":
        device = kwargs.get("device")
        return not _on_device(args[0]) and device is not None and device.type != "cpu"
    if name == "aten::copy_":
        return _on_device(args[0]) and isinstance(args[1], torch.Tensor) and not _on_device(args[1]) \
            and args[1].dim() > 0
    return False


def _step_on_meta(task, model, batch) -> tuple[list, list]:
    """Forward, loss and backward of the task's step on the meta device; the two modes' records."""
    model = model.to(META).train()
    reads, ops = HostReads(), ValueShapedOps()
    with reads, ops:
        out = task.step(model, batch)
        out.total.backward()
    assert out.total.device == META
    assert any(p.grad is not None and p.grad.device == META for p in model.parameters())
    return reads.seen, ops.seen


PILLAR_MODELS = ["point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
                 "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_cobevt", "point_pillar_where2comm"]


@pytest.mark.parametrize("config", PILLAR_MODELS)
def test_a_pillar_models_step_never_waits_for_its_device(toy_small, config):
    batch, model, task = toy_batch(TOY / f"{config}.yaml", toy_small)
    moved = task.move_to(batch, META)
    if "record_len" in moved["ego"]:  # the fusion models' batches: HOST_KEYS stay where the collate put them
        assert moved["ego"]["record_len"].device.type == "cpu"
    reads, ops = _step_on_meta(task, model, moved)
    assert (reads, ops) == ([], [])


def test_v2xvit_with_road_side_units_never_waits_for_its_device(toy_small_rsu):
    """V2X-ViT's typed layers and delays (prior_encoding), with infrastructure CAVs in the batch."""
    batch, model, task = toy_batch(TOY / "point_pillar_v2xvit.yaml", toy_small_rsu)
    prior = batch["ego"]["prior_encoding"]
    assert bool((prior[..., 2] == 1).any())  # the toy world's road-side units are in this batch
    reads, ops = _step_on_meta(task, model, task.move_to(batch, META))
    assert (reads, ops) == ([], [])


def test_a_linear_algebra_status_check_is_seen():
    """The control of READING_OPS: torch.linalg.inv's singular-matrix check reads the device's status back."""
    with pytest.raises(AssertionError, match="reads a device tensor back: aten::_linalg_check_errors"):
        with HostReads(), ValueShapedOps():
            torch.linalg.inv(torch.zeros(2, 3, 3, device=META))


def test_a_record_len_on_the_device_is_seen(toy_small):
    """The control: upstream's way, record_len on the device, is a read-back where the fusion splits the maps."""
    batch, model, task = toy_batch(TOY / "point_pillar_intermediate_fusion.yaml", toy_small)
    moved = task.move_to(batch, META)
    moved["ego"]["record_len"] = moved["ego"]["record_len"].to(META)
    with pytest.raises(AssertionError, match="reads a device tensor back"):
        _step_on_meta(task, model, moved)


WAITING_UPLOADS = {
    "new_tensor": lambda x: x.new_tensor([1.0, 2.0]),
    "tensor_on_the_device": lambda x: torch.tensor([1.0], device=x.device),
    "list_index": lambda x: x[[0, 2]],
    "list_index_of_a_dimension": lambda x: x[:, [1, 0]],
    "list_index_assigned": lambda x: x.__setitem__((slice(None), [1, 0]), 1.0),
    "blocking_to": lambda x: torch.ones(2, 2).to(x.device),
    "blocking_copy": lambda x: x.copy_(torch.ones(3, 2)),
}
NO_WAIT = {
    "device_constant": lambda x: device_constant([1.0, 2.0], x),
    "non_blocking_to": lambda x: torch.ones(2, 2).to(x.device, non_blocking=True),
    "positions_per_dimension": lambda x: x[0, 1],
    "slice_and_flip": lambda x: x[:, 0:2].flip(1),
    "host_scalar_tensor": lambda x: x.copy_(torch.tensor(1.0)),
    "python_scalar": lambda x: x * 2.0,
}


@pytest.mark.parametrize("name", sorted(WAITING_UPLOADS))
def test_a_blocking_host_to_device_copy_is_seen(name):
    """The control of the copies: each of these makes torch wait for the device on a GPU (see the top)."""
    x = torch.zeros(3, 2, device=META)
    with pytest.raises(AssertionError, match="copies host data to the device and waits"):
        with HostReads(), ValueShapedOps():
            WAITING_UPLOADS[name](x)


@pytest.mark.parametrize("name", sorted(NO_WAIT))
def test_what_the_models_do_instead_waits_for_nothing(name):
    x = torch.zeros(3, 2, device=META)
    reads, ops = HostReads(), ValueShapedOps()
    with reads, ops:
        NO_WAIT[name](x)
    assert (reads.seen, ops.seen) == ([], [])
