"""Checkpoints: upstream-compatible weights, sidecars, strict prefix-agnostic loading, atomic writes, RNG state."""
import hashlib
import os
import random
import stat
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.errors import CheckpointError


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 4, 3), bn=nn.BatchNorm2d(4), head=nn.Linear(4, 3)))


def _assert_same_state(a, b):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------------------------------- names
def test_file_names():
    assert ckpt.weights_name(7) == "net_epoch7.pth"
    assert ckpt.bestval_name(3) == "net_epoch_bestval_at3.pth"
    assert ckpt.state_name(12) == "training_state_epoch12.pt"


# ------------------------------------------------------------------------------------------- save_epoch
def test_save_epoch_writes_bare_state_dict_and_sidecar(tmp_path):
    model = _net()
    wrapped = nn.DataParallel(model)
    path = ckpt.save_epoch(tmp_path, 4, wrapped, {"optimizer": {"lr": 0.1}, "global_step": 40})
    assert path == tmp_path / "net_epoch4.pth"
    weights = torch.load(path, map_location="cpu")
    assert isinstance(weights, dict)
    assert not any(k.startswith("module.") for k in weights)
    assert set(weights) == {"conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
                            "bn.running_var", "bn.num_batches_tracked", "head.weight", "head.bias"}
    _assert_same_state(weights, model.state_dict())
    state = ckpt.load_training_state(tmp_path, 4)
    recorded = state.pop("weights")  # the sidecar describes the weights file it belongs to
    assert recorded == {"name": "net_epoch4.pth", "bytes": path.stat().st_size,
                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert state == {"optimizer": {"lr": 0.1}, "global_step": 40, "format": ckpt.STATE_FORMAT, "epoch": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net_epoch4.pth", "training_state_epoch4.pt"]


def test_save_epoch_without_training_state(tmp_path):
    ckpt.save_epoch(tmp_path, 1, _net(), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net_epoch1.pth"]
    assert ckpt.load_training_state(tmp_path, 1) is None


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_save_epoch_keeps_newest_sidecars(tmp_path, keep):
    model = _net()
    for epoch in range(1, 6):
        ckpt.save_epoch(tmp_path, epoch, model, {"step": epoch}, keep_states=keep)
    assert ckpt.epochs_on_disk(tmp_path) == [1, 2, 3, 4, 5]  # every weights file stays
    assert ckpt.epochs_on_disk(tmp_path, ckpt.STATE_RE) == list(range(6 - keep, 6))
    assert ckpt.load_training_state(tmp_path, 5)["step"] == 5


def test_save_epoch_sorts_epochs_numerically(tmp_path):
    model = _net()
    for epoch in (9, 10, 11):
        ckpt.save_epoch(tmp_path, epoch, model, {}, keep_states=2)
    assert ckpt.epochs_on_disk(tmp_path, ckpt.STATE_RE) == [10, 11]


def test_save_bestval_keeps_exactly_one(tmp_path):
    first, second = _net(0), _net(1)
    ckpt.save_epoch(tmp_path, 2, first, None)
    p2 = ckpt.save_bestval(tmp_path, 2, first)
    assert p2 == tmp_path / "net_epoch_bestval_at2.pth"
    p5 = ckpt.save_bestval(tmp_path, 5, second)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["net_epoch2.pth", "net_epoch_bestval_at5.pth"]
    _assert_same_state(torch.load(p5), second.state_dict())
    assert ckpt.epochs_on_disk(tmp_path, ckpt.BESTVAL_RE) == [5]
    ckpt.save_bestval(tmp_path, 5, first)  # same epoch again: replaced in place
    assert ckpt.epochs_on_disk(tmp_path, ckpt.BESTVAL_RE) == [5]
    _assert_same_state(torch.load(p5), first.state_dict())


def test_epochs_on_disk_ignores_other_files(tmp_path):
    model = _net()
    ckpt.save_epoch(tmp_path, 3, model, {"x": 1})
    ckpt.save_epoch(tmp_path, 12, model, {"x": 1})
    ckpt.save_bestval(tmp_path, 7, model)
    for name in ("config.yaml", "net_epoch.pth", "net_epoch5.pth.tmp", ".net_epoch8.pth.abc.tmp", "net_epochX.pth",
                 "latest.pth"):
        (tmp_path / name).write_text("x")
    assert ckpt.epochs_on_disk(tmp_path) == [3, 12]
    assert ckpt.epochs_on_disk(tmp_path, ckpt.STATE_RE) == [3, 12]
    assert ckpt.epochs_on_disk(tmp_path, ckpt.BESTVAL_RE) == [7]
    assert ckpt.epochs_on_disk(tmp_path / "missing") == []


# ------------------------------------------------------------------------------------------- load_weights
def test_load_weights_round_trip_from_file(tmp_path):
    source, target = _net(0), _net(1)
    path = ckpt.save_epoch(tmp_path, 1, source, None)
    ckpt.load_weights(target, path)
    _assert_same_state(target.state_dict(), source.state_dict())


def test_load_weights_accepts_module_prefix(tmp_path):
    source, target = _net(0), _net(1)
    prefixed = {f"module.{k}": v.clone() for k, v in source.state_dict().items()}
    ckpt.load_weights(target, prefixed)
    _assert_same_state(target.state_dict(), source.state_dict())
    # and from a file, into a wrapped model
    path = tmp_path / "prefixed.pth"
    torch.save(prefixed, path)
    other = _net(2)
    ckpt.load_weights(nn.DataParallel(other), path)
    _assert_same_state(other.state_dict(), source.state_dict())


def test_strip_module_prefix_only_when_all_keys_have_it():
    assert ckpt.strip_module_prefix({"module.a": 1, "module.b": 2}) == {"a": 1, "b": 2}
    assert ckpt.strip_module_prefix({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}
    assert ckpt.strip_module_prefix({}) == {}


def test_load_weights_renamed_layer_reports_missing_and_unexpected():
    source = _net(0)
    state = {k.replace("head.", "classifier."): v for k, v in source.state_dict().items()}
    target = _net(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(target, state)
    msg = str(info.value)
    assert "2 missing (head.weight, head.bias)" in msg
    assert "2 unexpected (classifier.weight, classifier.bias)" in msg
    assert "shape mismatch" not in msg
    _assert_same_state(target.state_dict(), before)  # nothing loaded


def test_load_weights_extra_layer_in_model_is_missing():
    source = _net(0)
    target = nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 4, 3), bn=nn.BatchNorm2d(4), head=nn.Linear(4, 3),
                                       extra=nn.Linear(3, 2)))
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(target, source.state_dict())
    msg = str(info.value)
    assert "2 missing (extra.weight, extra.bias)" in msg and "unexpected" not in msg


def test_load_weights_extra_key_in_checkpoint_is_unexpected():
    state = dict(_net(0).state_dict(), **{"extra.weight": torch.zeros(2, 3)})
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(_net(1), state)
    assert "1 unexpected (extra.weight)" in str(info.value) and "missing" not in str(info.value)


def test_load_weights_shape_mismatch_names_key_and_shapes(tmp_path):
    source = nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 4, 3), bn=nn.BatchNorm2d(4), head=nn.Linear(4, 5)))
    path = tmp_path / "net_epoch1.pth"
    torch.save(source.state_dict(), path)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(_net(1), path)
    msg = str(info.value)
    assert str(path) in msg
    assert "2 shape mismatch" in msg
    assert "head.weight: checkpoint [5, 4] vs model [3, 4]" in msg
    assert "head.bias: checkpoint [5] vs model [3]" in msg
    assert "missing" not in msg and "unexpected" not in msg


def test_load_weights_all_three_problems_in_one_message():
    target = nn.Sequential(OrderedDict(a=nn.Linear(2, 3), b=nn.Linear(3, 3)))
    state = {"a.weight": torch.zeros(4, 2), "a.bias": torch.zeros(3), "c.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(target, state)
    msg = str(info.value)
    assert "2 missing (b.weight, b.bias)" in msg
    assert "1 unexpected (c.weight)" in msg
    assert "1 shape mismatch (a.weight: checkpoint [4, 2] vs model [3, 2])" in msg
    assert "the given state dict" in msg


def test_describe_mismatch_limits_the_list():
    model_state = {f"k{i}": torch.zeros(1) for i in range(8)}
    report = ckpt.describe_mismatch(model_state, {}, limit=5)
    assert report == "8 missing (k0, k1, k2, k3, k4, ... (+3))"
    assert ckpt.describe_mismatch(model_state, dict(model_state)) == ""


def test_load_weights_non_strict_loads_the_matching_part():
    source = _net(0)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}
    target = _net(1)
    ckpt.load_weights(target, state, strict=False)
    assert torch.equal(target.conv.weight, source.conv.weight)
    assert not torch.equal(target.head.weight, source.head.weight)


def test_load_weights_rejects_non_mapping(tmp_path):
    path = tmp_path / "list.pth"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_weights(_net(), path)
    assert str(path) in str(info.value) and "holds a list" in str(info.value)


def test_unwrap():
    inner = _net()
    assert ckpt.unwrap(nn.DataParallel(inner)) is inner
    assert ckpt.unwrap(nn.DataParallel(nn.DataParallel(inner))) is inner
    assert ckpt.unwrap(inner) is inner
    assert list(nn.DataParallel(inner).state_dict())[0] == "module.conv.weight"
    assert list(ckpt.unwrap(nn.DataParallel(inner)).state_dict())[0] == "conv.weight"


# ------------------------------------------------------------------------------------------- atomic write
class _Explodes:
    def __reduce__(self):
        raise RuntimeError("pickling failed on purpose")


def test_atomic_save_failure_keeps_old_file(tmp_path):
    path = tmp_path / "net_epoch1.pth"
    good = {"w": torch.arange(1000, dtype=torch.float32)}
    ckpt.atomic_save(good, path)
    before = path.read_bytes()
    bad = {"w": torch.ones(100000), "later": _Explodes()}  # a big tensor first, then the failure
    with pytest.raises(RuntimeError, match="pickling failed on purpose"):
        ckpt.atomic_save(bad, path)
    assert path.read_bytes() == before
    assert torch.equal(ckpt.load_file(path)["w"], good["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["net_epoch1.pth"]  # no temporary file left


def test_atomic_save_failure_without_old_file_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        ckpt.atomic_save({"x": _Explodes()}, tmp_path / "new.pth")
    assert list(tmp_path.iterdir()) == []


def test_atomic_save_into_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.atomic_save({"a": 1}, tmp_path / "missing" / "x.pth")


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_atomic_save_permission_follows_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = tmp_path / "w.pth"
        ckpt.atomic_save({"a": torch.zeros(2)}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


# ------------------------------------------------------------------------------------------- load_file
def test_truncated_checkpoint_is_a_checkpoint_error(tmp_path):
    path = ckpt.save_epoch(tmp_path, 3, _net(), None)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        ckpt.load_file(path)
    assert str(path) in str(info.value) and "truncated or corrupt" in str(info.value)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ckpt.load_weights(_net(), path)


def test_empty_checkpoint(tmp_path):
    path = tmp_path / "empty.pth"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        ckpt.load_file(path)
    assert str(path) in str(info.value) and "truncated or corrupt" in str(info.value)


@pytest.mark.parametrize("content", [b"this is not a checkpoint at all",
                                     b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n",
                                     b"\0" * 100], ids=["garbage", "git-lfs-pointer", "zero-filled"])
def test_garbage_checkpoint_is_a_checkpoint_error(tmp_path, content):
    path = tmp_path / "net_epoch1.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_file(path)
    assert str(path) in str(info.value) and "truncated or corrupt" in str(info.value)


def test_missing_checkpoint(tmp_path):
    path = tmp_path / "net_epoch9.pth"
    with pytest.raises(CheckpointError) as info:
        ckpt.load_file(path)
    assert str(path) in str(info.value) and "does not exist" in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load_weights(_net(), path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load_file(tmp_path)  # a folder is not a checkpoint file


def test_training_state_of_unknown_format(tmp_path):
    torch.save({"format": 99, "epoch": 1}, tmp_path / "training_state_epoch1.pt")
    with pytest.raises(CheckpointError, match="unknown format"):
        ckpt.load_training_state(tmp_path, 1)
    torch.save([1], tmp_path / "training_state_epoch2.pt")
    with pytest.raises(CheckpointError, match="unknown format"):
        ckpt.load_training_state(tmp_path, 2)


# ------------------------------------------------------------------------------------------- RNG
def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(9)
    state = ckpt.rng_state()
    expected = (torch.rand(5), np.random.rand(3), [random.random() for _ in range(3)])
    torch.rand(100), np.random.rand(100), random.random()  # move every generator on

    path = tmp_path / "rng.pt"
    ckpt.atomic_save({"rng": state}, path)
    ckpt.set_rng_state(ckpt.load_file(path)["rng"])
    got = (torch.rand(5), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    assert got[2] == expected[2]
    assert set(state) >= {"torch", "numpy", "python"}
