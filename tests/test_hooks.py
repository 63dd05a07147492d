"""The fit loop's hooks and RunCheckpointer, in one process on the engine's synthetic task.

The multi-process behaviour of the same code (every rank calls the hooks and the collective saves) is covered by
the runs of test_train_engine, test_resilience and test_end_to_end; here: what each hook and the checkpointer
writes, in which order the loop calls them, and that a hook on another rank writes nothing.
"""
import math
import os
from pathlib import Path

import pytest
import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed.batch_plan import make_batch_plan
from opencood_ddp.distributed.env import detect_dist_env
from opencood_ddp.engine.checkpointer import RunCheckpointer
from opencood_ddp.engine.hooks import (EpochLineHook, EpochSummary, Hooks, StepCsvHook, StepRecord,
                                       TensorBoardHook, TrainHook, default_hooks)
from opencood_ddp.engine.logs import read_step_log, setup_logging
from opencood_ddp.engine.options import ProcessOptions, LoopOptions, TrainOptions
from opencood_ddp.engine.run_dir import RunSetup
from opencood_ddp.engine.trainer import Trainer
from opencood_ddp.errors import CheckpointError
from opencood_ddp.tasks import build_task
from upstream_loop import upstream_step_lrs
from zoo import hypes_of

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "hypes_yaml" / "toy" / "synthetic_bn.yaml"


class Recorder(TrainHook):
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def on_resume(self, global_step):
        self.calls.append((self.name, "resume", global_step))

    def on_epoch_start(self, epoch, epochs, done_steps, steps_per_epoch):
        self.calls.append((self.name, "epoch_start", epoch, done_steps, steps_per_epoch))

    def on_step(self, record, global_batch):
        self.calls.append((self.name, "step", record.step, global_batch))

    def on_epoch_exit(self):
        self.calls.append((self.name, "epoch_exit"))

    def on_epoch_end(self, summary):
        self.calls.append((self.name, "epoch_end", summary.epoch, sorted(summary.train), summary.val is not None))

    def on_fit_end(self):
        self.calls.append((self.name, "fit_end"))

    def close(self):
        self.calls.append((self.name, "close"))


def _trainer(run_dir: Path, hooks=None, num_train=32, epochs=2, lr_scheduler=None, per_rank=None,
             max_steps=None, workers=0) -> Trainer:
    """The synthetic task's trainer on one process (batch 8: num_train / 8 steps per epoch); `lr_scheduler`
    replaces the hypes' section, `per_rank` < 8 accumulates, `workers` loader workers."""
    sections = {} if lr_scheduler is None else {"lr_scheduler": lr_scheduler}
    hypes = hypes_of(SYNTHETIC, f"synthetic.num_train={num_train}", f"train_params.epoches={epochs}", **sections)
    env = detect_dist_env({})  # one process, no process group
    setup_logging(env.rank)
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)
    plan = make_batch_plan(hypes["train_params"]["batch_size"], 1, float(hypes["optimizer"]["lr"]),
                           per_gpu_batch=per_rank)
    hypes["train_params"]["seed"] = 0
    options = TrainOptions(loop=LoopOptions(max_steps=max_steps), process=ProcessOptions(num_workers=workers))
    return Trainer(task, plan, env, options, RunSetup(Path(run_dir), False, hypes, str(SYNTHETIC)), hooks)


def _record(step: int, loss: float = 1.0) -> StepRecord:
    return StepRecord(step=step, epoch=0, losses={"loss": loss}, lr=0.1, seconds=0.5, data_seconds=0.1)


def test_loop_calls_every_hook_in_order(tmp_path):
    calls = []
    trainer = _trainer(tmp_path, Hooks([Recorder("a", calls), Recorder("b", calls)]))
    trainer.fit()
    a = [call[1:] for call in calls if call[0] == "a"]
    assert [call[1:] for call in calls if call[0] == "b"] == a
    # "a" is called before "b" at every event: the calls alternate
    assert [call[0] for call in calls] == ["a", "b"] * len(a)
    epoch = [("epoch_start", 0, 0, 4), *[("step", s, 8) for s in (1, 2, 3, 4)], ("epoch_exit",),
             ("epoch_end", 1, ["l1", "loss"], True)]
    second = [("epoch_start", 1, 0, 4), *[("step", s, 8) for s in (5, 6, 7, 8)], ("epoch_exit",),
              ("epoch_end", 2, ["l1", "loss"], True)]
    assert a == epoch + second + [("fit_end",)]


def test_an_error_in_a_step_still_closes_the_epoch(tmp_path):
    calls = []

    class Failing(TrainHook):
        def on_step(self, record, global_batch):
            raise RuntimeError("hook failed")

    trainer = _trainer(tmp_path, Hooks([Recorder("a", calls), Failing()]))
    with pytest.raises(RuntimeError, match="hook failed"):
        trainer.fit()
    assert [call[1] for call in calls] == ["epoch_start", "step", "epoch_exit"]


def test_default_hooks_write_the_csv_and_one_event_file(tmp_path):
    trainer = _trainer(tmp_path, default_hooks(tmp_path, is_main=True))
    trainer.fit()
    trainer.hooks.close()
    rows = read_step_log(tmp_path / "train_steps.csv")
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in tmp_path.glob("net_epoch*.pth"))[:2] == ["net_epoch1.pth", "net_epoch2.pth"]


def test_hooks_of_other_ranks_write_nothing(tmp_path):
    hooks = default_hooks(tmp_path, is_main=False)
    hooks.on_resume(0)
    hooks.on_epoch_start(0, 1, 0, 2)
    hooks.on_step(_record(1), 8)
    hooks.on_epoch_exit()
    hooks.on_epoch_end(EpochSummary(1, 1, {"loss": 1.0}, {"loss": 2.0}, 0.1, "t"))
    hooks.on_fit_end()
    hooks.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_opens_its_file_at_the_first_scalar(tmp_path):
    hook = TensorBoardHook(tmp_path, is_main=True)
    hook.on_fit_end()
    hook.close()
    assert list(tmp_path.iterdir()) == []  # a run that failed before its first step leaves no event file
    hook.on_step(_record(1), 8)
    hook.on_epoch_end(EpochSummary(1, 1, {"loss": 1.0}, {"loss": 2.0}, 0.1, "t"))
    hook.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_step_csv_resume_drops_the_steps_trained_again(tmp_path):
    hook = StepCsvHook(tmp_path, is_main=True)
    for step in range(1, 6):
        hook.on_step(_record(step, loss=float(step)), 8)
    StepCsvHook(tmp_path, is_main=True).on_resume(3)
    rows = read_step_log(tmp_path / "train_steps.csv")
    assert [(row["step"], row["loss"], row["samples_per_s"]) for row in rows] == [(1, 1.0, 16.0), (2, 2.0, 16.0),
                                                                                 (3, 3.0, 16.0)]


def test_epoch_line_names_train_val_and_lr(tmp_path):
    log_path = tmp_path / "rank0.log"
    logger = setup_logging(0)
    import logging
    handler = logging.FileHandler(log_path)
    logger.addHandler(handler)
    try:
        EpochLineHook().on_epoch_end(EpochSummary(3, 10, {"loss": 1.25, "cls": 0.5}, {"loss": 2.0}, 0.002,
                                                  "5.0 samples/s"))
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert log_path.read_text().strip() == ("epoch 3/10 train loss=1.2500 cls=0.5000 | val loss=2.0000 | lr 0.002 "
                                            "| 5.0 samples/s")


# ------------------------------------------------------------------------------------------------ checkpointer
def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_checkpointer_saves_epoch_best_and_mid_epoch(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=True, keep_states=1)
    net = _net(0)
    saver.save_epoch(1, net, lambda: {"global_step": 4}, due=True, new_best=2.5)
    assert saver.last_weights == tmp_path / "net_epoch1.pth"
    saver.save_epoch(2, net, lambda: {"global_step": 8}, due=False, new_best=1.5)  # best, but not due
    assert saver.last_weights == tmp_path / "net_epoch1.pth"
    path = saver.save_mid_epoch(net, lambda: {"global_step": 10}, global_step=10, epoch=2, step_in_epoch=2)
    assert path == saver.last_weights == tmp_path / "net_step10.pth"
    saver.save_epoch(3, net, lambda: {"global_step": 12}, due=True, new_best=None)
    names = sorted(p.name for p in tmp_path.iterdir())
    # the epoch save superseded the mid-epoch one; keep_states=1 kept the newest sidecar; one best-val file
    assert names == ["net_epoch1.pth", "net_epoch3.pth", "net_epoch_bestval_at2.pth", "training_state_epoch3.pt"]
    state = ckpt.load_state_file(tmp_path / "training_state_epoch3.pt")
    assert state["global_step"] == 12 and state["epoch"] == 3 and len(state["rng"]) == 1


def test_checkpointer_of_another_rank_writes_nothing(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=False)
    net = _net(0)
    saver.save_epoch(1, net, lambda: pytest.fail("only rank 0 builds the state"), due=True, new_best=1.0)
    saver.save_mid_epoch(net, lambda: pytest.fail("only rank 0 builds the state"), 3, 0, 3)
    saver.write_config({"name": "x"}, make_batch_plan(8, 1, 0.1))
    assert list(tmp_path.iterdir()) == [] and saver.last_weights == tmp_path / "net_step3.pth"
    assert saver.remove_unfinished_saves() == []


def test_checkpointer_resumes_the_newest_that_loads(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=True)
    saver.save_epoch(1, _net(1), lambda: {"global_step": 4}, due=True, new_best=None)
    saver.save_epoch(2, _net(2), lambda: {"global_step": 8}, due=True, new_best=None)
    data = (tmp_path / "net_epoch2.pth").read_bytes()
    (tmp_path / "net_epoch2.pth").write_bytes(data[: len(data) // 2])  # a torn file
    target = _net(3)
    found = saver.resume(target, steps_per_epoch=4)
    assert found.saved.number == 1 and found.state["global_step"] == 4
    assert len(found.passed_over) == 1 and "net_epoch2.pth" in found.passed_over[0]
    for key, value in _net(1).state_dict().items():
        assert torch.equal(target.state_dict()[key], value)
    assert RunCheckpointer(tmp_path / "empty", is_main=True).resume(target, 4).saved is None


def test_checkpointer_refuses_another_models_weights(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=True)
    saver.save_epoch(1, torch.nn.Linear(2, 2), lambda: {"global_step": 4}, due=True, new_best=None)
    with pytest.raises(CheckpointError, match="net_epoch1.pth does not match the model"):
        saver.resume(_net(0), steps_per_epoch=4)


def test_checkpointer_write_config_and_unfinished_saves(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=True)
    saver.write_config({"name": "x", "train_params": {"batch_size": 8}}, make_batch_plan(8, 2, 0.1))
    config = hypes_lib.load_hypes(tmp_path / "config.yaml")  # as written: the loader would drop batch_plan
    assert config["batch_plan"]["global_batch"] == 8 and config["batch_plan"]["world_size"] == 2
    (tmp_path / ".net_epoch3.pth.tmp").write_bytes(b"partial")
    assert saver.remove_unfinished_saves() == [".net_epoch3.pth.tmp"]
    assert not (tmp_path / ".net_epoch3.pth.tmp").exists()
    assert os.listdir(tmp_path) == ["config.yaml"]


# ------------------------------------------------------------------------------------------------ progress output
def test_a_piped_stream_gets_plain_progress_lines_not_carriage_returns():
    import io

    from opencood_ddp.engine.logs import PlainProgress, progress

    stream = io.StringIO()  # not a terminal, as a cluster job's log
    bar = progress(10, "epoch 1/2", is_main=True, stream=stream)
    assert isinstance(bar, PlainProgress)
    bar.interval_s = 0.0  # a line at every update here; 30 s in a run
    bar.set_postfix(loss="0.5000")
    bar.update(4)
    bar.close()
    assert "\r" not in stream.getvalue()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2: 4/10 (") and lines[0].endswith(" loss=0.5000") and len(lines) == 2
    quiet = io.StringIO()
    other = progress(10, "epoch 1/2", is_main=False, stream=quiet)
    other.update(3)
    other.close()
    assert quiet.getvalue() == ""


def test_tensorboard_writes_no_non_finite_scalar(tmp_path):
    hook = TensorBoardHook(tmp_path, is_main=True)
    hook.on_step(StepRecord(step=1, epoch=0, losses={"loss": float("nan"), "cls": float("inf"), "reg": 0.25},
                            lr=0.1, seconds=0.5, data_seconds=0.1, skipped=True), 8)
    hook.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    scalars = [(e.step, value.tag, value.simple_value) for e in _events(path) for value in e.summary.value]
    # The file holds the finite scalars alone: the lr and the finite loss term, never the NaN or the Inf.
    assert sorted(scalars) == [(1, "train/lr", pytest.approx(0.1)), (1, "train/reg", 0.25)]


@pytest.mark.slow
def test_a_piped_training_log_has_no_progress_frames(tmp_path):
    from launch import explain, train

    # In process, as a plain `python ... > log` start: rank 0 draws the bar on a stream that is not a terminal.
    result = train(0, "--hypes_yaml", SYNTHETIC, "--model_dir", tmp_path / "run", "--num_workers", "0")
    assert result.returncode == 0, explain(result)
    assert "\r" not in result.stderr and "it/s" not in result.stderr, result.stderr[-2000:]
    assert "epoch 1/2: 10/10 (" in result.stderr  # the line each epoch ends with


def test_checkpointer_passes_over_a_swapped_in_file_for_the_newest_that_loads(tmp_path):
    saver = RunCheckpointer(tmp_path, is_main=True)
    saver.save_epoch(1, _net(1), lambda: {"global_step": 4}, due=True, new_best=None)
    saver.save_epoch(2, _net(2), lambda: {"global_step": 8}, due=True, new_best=None)
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "net_epoch2.pth")  # another model's, copied in
    target = _net(3)
    found = saver.resume(target, steps_per_epoch=4)
    assert found.saved.number == 1
    assert len(found.passed_over) == 1 and "net_epoch2.pth" in found.passed_over[0]
    assert all(torch.equal(target.state_dict()[k], v) for k, v in _net(1).state_dict().items())


def _events(path) -> list:
    """The Event protos of one event file (TFRecord: length, its crc, the data, its crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    data, events, offset = path.read_bytes(), [], 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[offset + 12:offset + 12 + length])
        events.append(event)
        offset += 12 + length + 4
    return events


def test_a_resumed_run_tells_tensorboard_to_purge_the_steps_past_its_checkpoint(tmp_path):
    first = TensorBoardHook(tmp_path / "a", is_main=True)
    first.on_step(_record(1), 8)
    first.close()
    again = TensorBoardHook(tmp_path / "b", is_main=True)
    again.on_resume(2)  # steps 3.. are trained again
    again.on_step(_record(3, loss=5.0), 8)
    again.close()
    from tensorboardX.proto import event_pb2

    def starts(folder):
        (path,) = folder.glob("events.out.tfevents.*")
        return [(e.step, e.session_log.status) for e in _events(path) if e.HasField("session_log")]

    # TensorBoard drops the earlier files' events from the step of a START session log on (its purge rule)
    assert starts(tmp_path / "b") == [(3, event_pb2.SessionLog.START)]
    assert starts(tmp_path / "a") == []


# ------------------------------------------------------------------------------------------------ the lr of a step
# 4 steps per epoch (32 samples, batch 8), 4 epochs: warm-up over epoch 1, the cosine over epochs 1-3, lr_min in 4.
COSINE = {"core_method": "cosineannealwarm", "epoches": 3, "warmup_epoches": 1, "warmup_lr": 0.005, "lr_min": 0.001}
BASE_LR, STEPS_PER_EPOCH = 0.05, 4  # synthetic_bn.yaml's lr; num_train 32 / batch 8


def _logged_lrs(run_dir: Path) -> list:
    return [row["lr"] for row in read_step_log(run_dir / "train_steps.csv")]


def _tensorboard_lrs(run_dir: Path) -> list:
    events = [e for path in sorted(run_dir.glob("events.out.tfevents.*")) for e in _events(path)]
    return [value.simple_value for e in events for value in e.summary.value if value.tag == "train/lr"]


@pytest.mark.parametrize("section, per_rank", [(COSINE, None), (COSINE, 4), (None, None)],
                         ids=["cosine", "cosine-accumulating-2", "multistep"])
def test_each_step_logs_the_lr_it_ran_with_as_upstreams_loop_sets_it(tmp_path, section, per_rank):
    """train_steps.csv and TensorBoard against upstream's loop replayed by hand; with accumulation the schedule
    moves per optimizer step, not per micro-batch."""
    trainer = _trainer(tmp_path, default_hooks(tmp_path, is_main=True), epochs=4, lr_scheduler=section,
                       per_rank=per_rank)
    assert trainer.plan.accumulation == (2 if per_rank else 1) and trainer.steps_per_epoch == STEPS_PER_EPOCH
    trainer.fit()
    trainer.hooks.close()
    expected = upstream_step_lrs(section or hypes_of(SYNTHETIC)["lr_scheduler"], BASE_LR,
                                 STEPS_PER_EPOCH, 4)
    assert _logged_lrs(tmp_path) == pytest.approx(expected, rel=1e-6)
    assert _tensorboard_lrs(tmp_path) == pytest.approx(expected, rel=1e-6)  # float32 scalars


def _resume(run_dir: Path) -> Trainer:
    """A new trainer on the run folder, resumed as tools/train_ddp.py does, then fitted to the end (4 epochs)."""
    trainer = _trainer(run_dir, default_hooks(run_dir, is_main=True), epochs=4, lr_scheduler=COSINE)
    trainer.resume()  # also rewinds the hooks, as tools/train_ddp.py's resume
    trainer.fit()
    trainer.hooks.close()
    return trainer


def test_cosine_resumed_mid_epoch_goes_on_at_the_exact_step(tmp_path):
    first = _trainer(tmp_path, default_hooks(tmp_path, is_main=True), epochs=4, lr_scheduler=COSINE, max_steps=6)
    first.fit()
    first.hooks.close()
    assert (tmp_path / "net_step6.pth").is_file()  # step 2 of epoch 2
    _resume(tmp_path)
    assert _logged_lrs(tmp_path) == pytest.approx(upstream_step_lrs(COSINE, BASE_LR, STEPS_PER_EPOCH, 4), rel=1e-6)


def test_cosine_resumed_from_weights_alone_starts_the_epoch_as_upstream(tmp_path):
    """An upstream run folder holds net_epoch{N}.pth only: upstream's loop sets t = N x steps per epoch."""
    first = _trainer(tmp_path, default_hooks(tmp_path, is_main=True), epochs=2, lr_scheduler=COSINE)
    first.fit()
    first.hooks.close()
    for state in tmp_path.glob("training_state_*.pt"):
        state.unlink()
    resumed = _resume(tmp_path)
    assert resumed.progress.global_step == 4 * STEPS_PER_EPOCH
    assert _logged_lrs(tmp_path) == pytest.approx(upstream_step_lrs(COSINE, BASE_LR, STEPS_PER_EPOCH, 4), rel=1e-6)


def test_gradscaler_skipped_steps_are_not_non_finite_steps(tmp_path):
    """Under float16 a GradScaler skips the steps whose scaled gradients overflow and lowers its scale: normal,
    not the non-finite policy's business. A real CPU GradScaler with a scale past float32's range overflows the
    first steps' gradients; the run goes on and takes them as steps, and the policy records no skip."""
    trainer = _trainer(tmp_path, epochs=1)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=1000)
    trainer.fit()
    assert trainer.progress.global_step == 4 and trainer.progress.skipped_steps == []
    skipped_by_scaler = 127 - int(math.log2(trainer.scaler.get_scale()))  # each skip halves the scale
    assert 1 <= skipped_by_scaler <= 4


def test_the_reading_path_to_the_optimizer_step_is_six_frames_in_three_files(tmp_path):
    """From tools/train_ddp.py to optimizer.step(): the tool, engine/train.py's main, Trainer.fit, Trainer.steps,
    Trainer._train_step and optimizer_step (docs/architecture.md, README's reading path), seen from a real
    optimizer step of a real run through the tool's own entry."""
    import traceback

    from launch import in_process

    seen = []

    def record(optimizer, args, kwargs):
        if not seen:
            seen.append(traceback.extract_stack())

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(record)
    try:
        result = in_process(ROOT / "tools" / "train_ddp.py", "--hypes_yaml", SYNTHETIC, "--model_dir",
                            tmp_path / "run", "--num_workers", "0", "--max_steps", "1")
    finally:
        handle.remove()
    assert result.returncode == 0, result.stderr
    stack = seen[0]
    start = next(i for i, frame in enumerate(stack) if frame.filename.endswith("tools/train_ddp.py"))
    end = max(i for i, frame in enumerate(stack) if "/opencood_ddp/" in frame.filename)
    path = [(Path(frame.filename).name, frame.name) for frame in stack[start:end + 1]]
    assert path == [("train_ddp.py", "<module>"), ("train.py", "main"), ("trainer.py", "fit"),
                    ("trainer.py", "steps"), ("trainer.py", "_train_step"), ("trainer.py", "optimizer_step")]


def test_a_step_log_widens_when_a_resume_logs_a_new_column(tmp_path):
    """A float32 start, then a resume under --half fp16: its scaler_skipped column was dropped (the header is the
    first start's). The file is rewritten with the column, empty (NaN) on the earlier rows."""
    from opencood_ddp.engine.logs import StepLog, read_step_log

    StepLog(tmp_path, is_main=True).write({"step": 1, "epoch": 1, "loss": 2.0})
    StepLog(tmp_path, is_main=True).write({"step": 2, "epoch": 1, "loss": 1.5, "scaler_skipped": 1})
    rows = read_step_log(tmp_path / "train_steps.csv")
    assert [list(row) for row in rows] == [["step", "epoch", "loss", "scaler_skipped"]] * 2
    assert math.isnan(rows[0]["scaler_skipped"]) and rows[1]["scaler_skipped"] == 1.0
    assert [row["loss"] for row in rows] == [2.0, 1.5]
