"""The engine's evaluation merge: records from every rank back in dataset order, each frame exactly once."""
import pytest

from opencood_ddp.distributed.samplers import EvalShardSampler
from opencood_ddp.engine.evaluator import in_dataset_order
from opencood_ddp.engine.inference import choose_checkpoint
from opencood_ddp.tasks.opencood import eval_file_name
from opencood_ddp.errors import CheckpointError


@pytest.mark.parametrize("frames, world", [(7, 1), (7, 2), (7, 3), (2, 4), (0, 2)])
def test_shards_merge_back_to_dataset_order(frames, world):
    per_rank = [[(i, f"record{i}") for i in EvalShardSampler(frames, world, rank)] for rank in range(world)]
    assert in_dataset_order(per_rank[::-1], frames) == [f"record{i}" for i in range(frames)]


def test_merge_refuses_missing_or_repeated_frames():
    with pytest.raises(RuntimeError, match="covered 2 frames of 3"):
        in_dataset_order([[(0, "a")], [(2, "c")]], 3)
    with pytest.raises(RuntimeError, match="not each exactly once"):
        in_dataset_order([[(0, "a"), (1, "b")], [(1, "b")]], 2)


def test_checkpoint_choice(tmp_path):
    for name in ("net_epoch1.pth", "net_epoch12.pth", "net_epoch3.pth", "net_epoch_bestval_at3.pth"):
        (tmp_path / name).write_bytes(b"x")
    assert choose_checkpoint(tmp_path, None, False).name == "net_epoch12.pth"  # the highest epoch, as upstream
    assert choose_checkpoint(tmp_path, 3, False).name == "net_epoch3.pth"
    assert choose_checkpoint(tmp_path, None, True).name == "net_epoch_bestval_at3.pth"
    with pytest.raises(CheckpointError, match=r"no net_epoch5.pth \(epochs on disk: \[1, 3, 12\]\)"):
        choose_checkpoint(tmp_path, 5, False)
    with pytest.raises(CheckpointError, match="no net_epoch\\*.pth checkpoint"):
        choose_checkpoint(tmp_path / "empty_run", None, False)
    assert eval_file_name(False) == "eval.yaml" and eval_file_name(True) == "eval_global_sort.yaml"
