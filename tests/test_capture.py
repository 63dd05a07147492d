"""--capture (engine/capture.py): the dense part of the step compiled, its results the eager step's.

The checks compile with backend aot_eager (the traced graphs run by torch's eager kernels, seconds a compile here):
it must repeat the eager step bit for bit, so any difference is the capture path's (a wrong guard, a stale layout).
Every comparison runs both sides under numerics/kernel_path.cuda_kernels_on_cpu, as the captured step does.

Inductor (--capture compile) fuses and rounds anew, so it cannot equal the eager step; how near it is is a
measurement, not a test here (an inductor compile takes minutes on 2 cores): tools/benchmarks/benchmark_capture.py
sets its gap to float64 beside eager float32's, and docs/capture.md keeps the figures and the verdict. One tiny
model (a convolution and a deblock) compiles with inductor here, in seconds, for inductor's options.

On CUDA the captured graphs need not round as the eager step does (the GPU's kernels may be chosen otherwise inside
a graph), so the CUDA tests hold a capture to docs/capture.md's rule for a capture that rounds anew: its gaps to a
float64 eager run at most 4x eager float32's."""
from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
import torch
from torch import nn

from launch import REPO, WORKERS, explain, split_set_flags, torchrun, train
from opencood_ddp.engine.capture import CapturedStep, CaptureModule, CavCounts, check_capture, step_kernels
from opencood_ddp.engine.options import parse_train_options, train_argv
from opencood_ddp.engine.step import Precision, forward_backward
from opencood_ddp.engine.trainer import optimizer_step
from opencood_ddp.errors import ConfigError
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu
from zoo import hypes_of

ATTFUSE = "toy/point_pillar_intermediate_fusion"
CPU = torch.device("cpu")

# The float64 rule's measures are benchmark_capture's own, the tool docs/capture.md's verdict comes from; it imports
# its folder's benchmark_numerics (floats_as: a batch's floating tensors in a dtype) as a script does.
sys.path.insert(0, str(REPO / "tools" / "benchmarks"))
import benchmark_capture  # noqa: E402

floats_as = benchmark_capture.floats_as


@pytest.fixture(scope="module")
def attfuse(toy_small):
    """(task, (a, b)): AttFuse's toy task and two batches of two CAV layouts: one sample of 2 CAVs, two of 2."""
    from opencood_ddp.tasks import build_task

    torch.manual_seed(0)
    task = build_task(hypes_of(ATTFUSE, toy_root=toy_small), for_training=True)
    samples = [task.train_set[i] for i in range(3)]
    return task, (task.collate_train([samples[2]]), task.collate_train(samples[:2]))


@pytest.fixture(scope="module")
def coarse_attfuse(toy_small):
    """(task, batch): AttFuse's toy task on a grid of 0.6 m cells (160 x 80 pillars, 4/9 of the toy's) and
    one sample of 2 CAVs. For float16 on the CPU, whose convolutions' backward is torch's slow reference kernel
    (5 s a step at the toy's grid, 98 % of it): what is checked there does not depend on the grid."""
    from opencood_ddp.tasks import build_task

    torch.manual_seed(0)
    coarse = "[0.6, 0.6, 4]"
    task = build_task(hypes_of(ATTFUSE, f"preprocess.args.voxel_size={coarse}", f"model.args.voxel_size={coarse}",
                               toy_root=toy_small), for_training=True)
    return task, task.collate_train([task.train_set[2]])


def train_steps(task, batches, capture=None, after_step=lambda: None, half=None, scaler=None, device=CPU,
                accumulate=1, copy_between=True, dtype=torch.float32):
    """(losses, model) after one SGD step per `accumulate` batches, eager or through a CaptureModule made by
    `capture(model)`; one loss per batch; `after_step()` is called after each step. The step is the fit loop's
    (engine/trainer.py's _train_step and _micro_step): engine/step.forward_backward per micro-batch, its loss divided
    by `accumulate`, `CaptureModule.gradients_out_of_graphs` after each micro-batch but the step's last (unless not
    `copy_between`), then engine/trainer.optimizer_step, which sets the gradients to None; under `half` (--half's
    value) and with a GradScaler as the fit loop takes them. On `device` (the batches already there) with the
    kernels a captured step takes there; model and batches in `dtype` (float64: the reference of `float64_rule`)."""
    model = copy.deepcopy(task.model).to(device=device, dtype=dtype)
    batches = [floats_as(batch, dtype) for batch in batches]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1)  # the same dropout draws on both sides (V2X-ViT's, CoBEVT's)
    module = capture(model) if capture is not None else None
    precision = Precision(half, device)
    losses = []
    for index, batch in enumerate(batches, start=1):
        with step_kernels(device):
            out = forward_backward(CapturedStep() if module is not None else task.step, module or model, batch,
                                   precision, scaler, accumulate)
        losses.append(out.total.detach())
        if index % accumulate:  # another micro-batch of this step follows
            if module is not None and copy_between:
                module.gradients_out_of_graphs()
            continue
        optimizer_step(optimizer, scaler)
        after_step()
    return losses, model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles `dense_step` anew: dynamo keeps at most 8 graphs per code object for the process, and
    the tests here would share them (one past the limit would run eagerly and prove nothing)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # graph and break counts from this test's compiles only
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def one_thread():
    """Every comparison at 1 thread, as `make test`'s pytest processes run on 2 cores: at 2 threads the CPU's
    eager step does not repeat itself (toy AttFuse under cuda_kernels_on_cpu, two eager runs of one batch from the
    same weights: gradients up to 2e-6 apart, the heads' incoming gradients equal; 1 run, 2026-11-29), so no capture
    could equal it bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FLOAT64_FACTOR = 4  # docs/capture.md: a capture that rounds anew may be 4x as far from float64 as eager float32


def gaps_to(losses: list, model: nn.Module, exact_losses: list, exact: nn.Module) -> dict:
    """A float32 run's gaps to the float64 run, as benchmark_capture measures them: each loss's (relative), and
    the weights' and statistics' largest absolute and relative-norm ones."""
    loss_gaps = benchmark_capture.loss_gaps([loss.item() for loss in losses], [loss.item() for loss in exact_losses])
    return {"loss": loss_gaps, **benchmark_capture.weight_gaps(model, exact)}


def assert_float64_rule(task, batches, eager_run: tuple, captured_run: tuple, device, accumulate=1) -> None:
    """docs/capture.md's rule: each of the captured run's gaps to the float64 eager run (every loss; the weights'
    largest absolute and relative-norm gap) is at most FLOAT64_FACTOR x eager float32's, an eager loss gap under
    float32's own rounding floored there."""
    exact_losses, exact = train_steps(task, batches, device=device, accumulate=accumulate, dtype=torch.float64)
    eager, captured = (gaps_to(*run, exact_losses, exact) for run in (eager_run, captured_run))
    for index, (got, floor) in enumerate(zip(captured["loss"], eager["loss"]), start=1):
        assert got <= FLOAT64_FACTOR * max(floor, benchmark_capture.LOSS_FLOOR), ("loss", index, got, floor)
    for key in ("max_abs", "rel_norm"):
        assert captured[key] <= FLOAT64_FACTOR * eager[key], (key, captured[key], eager[key])


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x.double() - y.double()).abs().max().item()
               for x, y in zip(a.state_dict().values(), b.state_dict().values()) if x.is_floating_point())


def test_aot_eager_capture_is_the_eager_step_and_a_shape_past_the_limit_runs_eagerly(attfuse, caplog):
    """Layouts A, A, B with room for one compiled shape: A compiles, A replays its graphs (no new one traced), B is
    past the limit and runs eagerly. Every loss and every parameter and running statistic after the three steps
    equal the eager step's bit for bit."""
    from torch._dynamo.utils import counters

    task, (a, b) = attfuse  # A: the one-sample batch (the cheapest step), B: another CAV layout
    batches = [a, a, b]
    modules, graphs = [], []

    def capture(model):
        modules.append(CaptureModule(model, task.step, "aot_eager", CPU, max_shapes=1))
        return modules[0]

    eager_losses, eager = train_steps(task, batches)
    with caplog.at_level(logging.INFO):
        losses, captured = train_steps(task, batches, capture,
                                       after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
    assert max_difference(eager, captured) == 0.0
    assert graphs[1] == graphs[0] > 0 and graphs[2] == graphs[1], graphs  # A's replay and B traced nothing new
    module = modules[0]
    assert [counts for counts, _ in module.shapes] == [CavCounts((2,))]
    assert [counts for counts, _ in module.eager_shapes] == [CavCounts((2, 2))]
    assert caplog.text.count("compiling the dense step") == 1
    assert "past the 1 compiled shapes: its steps run eagerly" in caplog.text


def test_cudagraphs_capture_is_the_eager_step_and_skips_cuda_graphs_only_for_the_host(attfuse):
    """--capture cudagraphs on the CPU: dynamo's cudagraphs backend traces the graphs as on CUDA, finds no CUDA graph
    to make for a host tensor and runs them on the eager kernels. Two steps of layout A: the losses and every weight
    equal the eager step's bit for bit, one graph serves both, and torch counts one skip, its forward's, whose
    reason is the host (the backward's check is left out once the forward's skipped)."""
    from torch._dynamo.utils import counters

    from opencood_ddp.engine.census import cudagraph_skips

    task, (a, _) = attfuse
    eager_losses, eager = train_steps(task, [a, a])
    graphs = []
    with cudagraph_skips() as skips:
        losses, captured = train_steps(task, [a, a],
                                       lambda model: CaptureModule(model, task.step, "cudagraphs", CPU),
                                       after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
    assert max_difference(eager, captured) == 0.0
    assert graphs == [1, 1], graphs
    assert skips.count == 1 and len(skips.reasons) == 1 and "due to cpu device" in skips.reasons[0], skips


@pytest.mark.cuda  # CUDA graphs
def test_cudagraphs_capture_on_cuda_replays_the_eager_step(attfuse):
    """--capture cudagraphs on a GPU: the dense step's graphs, run by the eager kernels, are replayed as CUDA graphs
    (no skip), and three steps of layout A follow the eager step by docs/capture.md's float64 rule. On an H200
    (torch 2.11) the captured first loss was 2e-6 to 1e-5 (relative) from eager's, for most models: inside a
    graph the GPU may take other kernels, so bit for bit is not the GPU's promise, float32's accuracy is."""
    from opencood_ddp.engine.census import cudagraph_skips

    task, (a, _) = attfuse
    cuda = torch.device("cuda")
    batches = [task.move_to(a, cuda)] * 3
    eager_losses, eager = train_steps(task, batches, device=cuda)
    with cudagraph_skips() as skips:
        losses, captured = train_steps(task, batches, lambda model: CaptureModule(model, task.step, "cudagraphs", cuda),
                                       device=cuda)
    assert skips.count == 0, skips.reasons
    assert all(torch.isfinite(loss) for loss in losses) and losses[0].item() != losses[2].item()
    assert_float64_rule(task, batches, (eager_losses, eager), (losses, captured), cuda)


def test_copy_gradients_moves_each_gradient_to_memory_of_its_own_bit_for_bit():
    from opencood_ddp.engine.capture import copy_gradients

    model = nn.Linear(3, 2)
    copy_gradients(model)  # no gradient at all: nothing to copy
    assert model.weight.grad is None
    model.weight.grad = torch.tensor([[0.0, -0.0, float("nan")], [1e-45, -3.5, float("inf")]])
    before, address = model.weight.grad.clone(), model.weight.grad.data_ptr()
    copy_gradients(model)
    assert model.bias.grad is None  # a parameter without a gradient keeps none
    assert model.weight.grad.data_ptr() != address
    assert torch.equal(model.weight.grad.view(torch.int32), before.view(torch.int32))  # the bits, -0.0 and NaN's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cudagraphs_capture_accumulates_micro_batches_as_the_eager_step(attfuse, device):
    """The fit loop's accumulation under --capture cudagraphs, without DDP (one process, as `python
    tools/train_ddp.py` runs): two steps of two micro-batches (layouts A and A), the gradients copied out of the
    graphs' memory between them. On the CPU, whose graphs run on the eager kernels, the losses and weights are the
    eager accumulation's bit for bit; on CUDA they follow it by docs/capture.md's float64 rule (which the CPU's
    bit-for-bit run meets as well)."""
    task, (a, _) = attfuse
    device = torch.device(device)
    micro = [task.move_to(a, device)] * 4  # two steps of two micro-batches
    eager_losses, eager = train_steps(task, micro, device=device, accumulate=2)
    losses, captured = train_steps(task, micro, lambda m: CaptureModule(m, task.step, "cudagraphs", device),
                                   device=device, accumulate=2)
    assert losses[0].item() != losses[2].item()  # the first step moved the weights
    assert_float64_rule(task, micro, (eager_losses, eager), (losses, captured), device, accumulate=2)
    if device.type == "cpu":
        assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
        assert max_difference(eager, captured) == 0.0


@pytest.mark.cuda  # what the copy is for
def test_cudagraphs_capture_on_cuda_without_the_copy_loses_the_first_micro_batchs_gradients(attfuse):
    """The premise of `gradients_out_of_graphs`, on a GPU: without it, the first micro-batch's gradients, left in the
    CUDA graphs' memory, are overwritten by the second's replay, and torch refuses the step (its error names the
    overwritten gradient) or the weights leave the eager accumulation's. If this fails, torch keeps those
    gradients itself and the copy can go."""
    task, (a, _) = attfuse
    cuda = torch.device("cuda")
    micro = [task.move_to(a, cuda)] * 4  # two steps of two micro-batches
    _, eager = train_steps(task, micro, device=cuda, accumulate=2)
    _, eager_again = train_steps(task, micro, device=cuda, accumulate=2)
    try:
        _, uncopied = train_steps(task, micro, lambda m: CaptureModule(m, task.step, "cudagraphs", cuda),
                                  device=cuda, accumulate=2, copy_between=False)
    except RuntimeError as error:
        assert "overwritten" in str(error), error
        return
    assert max_difference(eager, uncopied) > max_difference(eager, eager_again)


@pytest.mark.parametrize("half", ["auto", "fp16"])
def test_aot_eager_capture_under_half_is_the_eager_step(request, half):
    """--capture with --half: on the CPU a bare --half is bfloat16 autocast (three steps of layout A); fp16 is
    float16 autocast with the GradScaler (two steps on the coarse grid, float16's slow CPU kernels), whose first
    scale (2^40) overflows float16 so that the first step is skipped, as eager skips it, and whose backoff leaves
    2^10 for the step taken. Every loss and every weight equal the eager step's under the same autocast bit for bit, the
    compiled graphs hold the autocast (the class head's convolution gives the 16-bit type inside them, the loss is
    not float32's) and one compile serves the steps (the autocast state and the changing scale trace nothing
    new)."""
    from torch._dynamo.utils import counters

    if half == "fp16":
        task, a = request.getfixturevalue("coarse_attfuse")
    else:
        task, (a, _) = request.getfixturevalue("attfuse")
    dtype = Precision(half, CPU).autocast_dtype
    batches, modules, graphs, scales, head_dtypes = [a] * (2 if half == "fp16" else 3), [], [], [], []
    # the hook overwrites a key: a list it appended to would change length, which dynamo guards on (a recompile a step)
    head = {"dtype": None}

    def new_scaler():  # a fresh one per run: the eager run's and the captured run's scale the same way
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -30) if half == "fp16" \
            else None

    def capture(model):
        model.cls_head.register_forward_hook(lambda module, args, output: head.update(dtype=output.dtype))
        modules.append(CaptureModule(model, task.step, "aot_eager", CPU, max_shapes=1))
        return modules[0]

    def after_step():
        graphs.append(counters["stats"]["unique_graphs"])
        head_dtypes.append(head["dtype"])
        head["dtype"] = None
        if scaler is not None:
            scales.append(scaler.get_scale())

    scaler = new_scaler()
    eager_losses, eager = train_steps(task, batches, half=half, scaler=scaler, after_step=after_step)
    eager_scales, scaler = scales[:], new_scaler()
    for record in (graphs, scales, head_dtypes):
        record.clear()
    compiled_before = counters["stats"]["unique_graphs"]
    losses, captured = train_steps(task, batches, capture, half=half, scaler=scaler, after_step=after_step)
    assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
    assert max_difference(eager, captured) == 0.0
    assert head_dtypes == [dtype] * len(batches), head_dtypes
    with torch.no_grad(), cuda_kernels_on_cpu():
        assert task.step(copy.deepcopy(task.model), a).total.item() != losses[0].item()  # float32's first loss
    assert graphs[0] > compiled_before and set(graphs) == {graphs[0]}, (compiled_before, graphs)
    assert len(modules[0].shapes) == 1 and not modules[0].eager_shapes
    if half == "fp16":
        assert scales == eager_scales == [2.0 ** 10] * 2
        assert losses[0].item() == losses[1].item()  # step 1 skipped: the weights step 2 ran with are the first
        assert max_difference(task.model, captured) > 0  # step 2 taken


@pytest.mark.parametrize("config, overrides", [
    ("toy/point_pillar_where2comm", ()),  # multi_scale: level 0 masked, every level fused
    ("toy/point_pillar_where2comm", ("model.args.where2comm_fusion.multi_scale=false",)),  # the shrunk map masked
    ("toy/second_intermediate_fusion", ()),  # spconv's sparse backbone in the eager front
    ("toy/point_pillar_v2vnet", ()),  # its identity flags from the layout
    ("toy/point_pillar_v2xvit", ()),  # its agents' rows from the layout
    ("toy/point_pillar_intermediate_fusion", ("fusion.args.proj_first=false",)),  # the warp at each level
    ("toy/point_pillar_v2vnet", ("fusion.args.proj_first=false",)),  # its pairwise warps
], ids=["where2comm-multi-scale", "where2comm-single-scale", "second", "v2vnet", "v2xvit", "attfuse-warped",
        "v2vnet-warped"])
def test_aot_eager_capture_of_the_layout_dependent_models_is_the_eager_step(toy_small, config, overrides):
    """The models whose dense part reads more of the layout than a plain backbone: Where2comm's communication (a
    confidence threshold's mask, the rates, all traced), SECOND (the front is spconv's, outside the graph), V2VNet
    (which samples need no warp) and V2X-ViT (its agents' rows); and, with proj_first: false (the DAIR-V2X
    configs), the warp into the ego's frame, whose moving rows the layout finds once per batch (until 2026-11-29
    each level's warp found them with a nonzero inside the graph: AttFuse's step was 13 graphs). Two steps on one
    two-sample batch: one graph, no break, the second step replays it, and every loss and weight is the eager
    step's bit for bit."""
    from torch._dynamo.utils import counters

    from opencood_ddp.tasks import build_task

    torch.manual_seed(0)
    task = build_task(hypes_of(config, *overrides, toy_root=toy_small), for_training=True)
    check_capture("aot_eager", task.model)
    batch = task.collate_train([task.train_set[i] for i in range(2)])
    eager_losses, eager = train_steps(task, [batch, batch])
    graphs = []
    losses, captured = train_steps(task, [batch, batch],
                                   lambda model: CaptureModule(model, task.step, "aot_eager", CPU),
                                   after_step=lambda: graphs.append(counters["stats"]["unique_graphs"]))
    assert [loss.item() for loss in losses] == [loss.item() for loss in eager_losses]
    assert losses[0].item() != losses[1].item()  # the first step moved the weights
    assert max_difference(eager, captured) == 0.0
    assert graphs == [1, 1], graphs  # one graph (counted from dynamo's reset), replayed by the second step
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


class TinySeam(nn.Module):
    """The smallest model with the front/layout/dense seam: a row per CAV, one score per sample."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def front(self, ego):
        return ego["rows"]

    def layout(self, ego):
        return {"record_len": ego["record_len"]}

    def dense(self, features, layout):
        per_sample = torch.split(self.linear(features), list(layout["record_len"].tolist()))
        return {"score": torch.stack([rows.sum() for rows in per_sample])}

    def forward(self, ego):
        return self.dense(self.front(ego), self.layout(ego))


def test_cheap_modes_compile_every_batch_2_layout_of_seven_cavs_past_dynamos_default_limit():
    """Per-GPU batch 2 on OPV2V (max_cav 7 in upstream's AttFuse file) meets up to 49 CAV layouts. `cudagraphs` and
    `aot_eager` compile in seconds and keep up to 49; inductor's `compile` (minutes each) 6. Ten layouts of the tiny
    seam model under `cudagraphs`: each compiles (10 graphs, past dynamo's default limit of 8, which CaptureModule
    raises), none runs eagerly, and every loss and gradient is the eager step's bit for bit."""
    from torch._dynamo.utils import counters

    from opencood_ddp.engine.capture import MAX_SHAPES
    from opencood_ddp.engine.task import LossOutput

    assert MAX_SHAPES == {"compile": 6, "cudagraphs": 49, "aot_eager": 49}

    def step(model, batch):
        return LossOutput(model(batch["ego"])["score"].square().sum(), {})

    torch.manual_seed(0)
    layouts = [(a, b) for a in range(1, 6) for b in range(1, 3)]  # 10 ordered pairs of CAV counts
    batches = [{"ego": {"rows": torch.randn(a + b, 2), "record_len": torch.tensor([a, b])}} for a, b in layouts]
    eager, model = TinySeam(), TinySeam()
    model.load_state_dict(eager.state_dict())
    module = CaptureModule(model, step, "cudagraphs", CPU)
    assert module.max_shapes == 49 and CaptureModule(TinySeam(), step, "compile", CPU).max_shapes == 6
    for batch in batches:
        expected, got = step(eager, batch), module(batch)
        expected.total.backward()
        got.total.backward()
        assert got.total.item() == expected.total.item()
    assert counters["stats"]["unique_graphs"] == len(layouts) and not module.eager_shapes
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(), model.parameters()))


def test_capture_flag_parses_and_passes_on():
    options = parse_train_options(["--hypes_yaml", "x.yaml", "--capture", "compile"])
    assert options.loop.capture == "compile"
    assert parse_train_options(train_argv(options)) == options
    assert parse_train_options([]).loop.capture is None
    assert parse_train_options(["--capture", "cudagraphs"]).loop.capture == "cudagraphs"
    with pytest.raises(SystemExit):
        parse_train_options(["--capture", "inductor"])  # compile's backend, not a mode


def test_capture_refuses_what_it_cannot_serve(attfuse):
    task, _ = attfuse
    with pytest.raises(ConfigError, match=r"^--capture compile: Linear's forward is not .*without --capture$"):
        check_capture("compile", nn.Linear(2, 2))
    check_capture("compile", task.model)
    check_capture(None, nn.Linear(2, 2))


@pytest.mark.slow
def test_two_rank_capture_trains(toy_small, tmp_path):
    """torchrun, 2 gloo ranks, batch norm synchronised over them: DDP wraps the CaptureModule, the compiled function
    runs inside its forward (the CPU's synchronised batch norm, GlooSyncBatchNorm, breaks the graph there and
    runs eagerly; the GPUs' is the next test's).
    The run compiles, takes its step and saves finite weights. As cheap as that proof allows: one step of one
    sample a rank, at most 2,000 pillars a cloud. Its weights are not the eager run's bit for bit: the captured step
    takes CUDA's kernels on the CPU (float32 batch-norm statistics), the eager run the float64 ones."""
    run_dir = tmp_path / "captured"
    result = train(2, "--hypes_yaml", REPO / "hypes_yaml" / f"{ATTFUSE}.yaml", "--model_dir", run_dir,
                   "--num_workers", "0", "--set", "train_params.batch_size=2", "--set", "train_params.epoches=1",
                   "--set", "preprocess.args.max_voxel_train=2000", "--max_steps", "1", "--capture", "aot_eager",
                   *split_set_flags(toy_small), timeout=600)
    assert result.returncode == 0, explain(result)
    assert "--capture aot_eager: compiling the dense step" in result.stdout + result.stderr
    weights = torch.load(run_dir / "net_step1.pth", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(value).all() for value in weights.values() if value.is_floating_point())


@pytest.mark.slow
def test_two_rank_capture_with_the_gpus_batch_norm_is_the_eager_step_in_one_graph(toy_small, tmp_path):
    """What N GPUs train with under --capture: DeviceSyncBatchNorm in a CaptureModule in DDP, here on 2 gloo ranks
    over the CPU stand-ins of its CUDA kernels (tests/workers/capture_sync_bn_worker.py), captured with aot_eager
    and with cudagraphs (AOTAutograd's other partition of forward and backward, the backend --capture cudagraphs
    takes on CUDA). In each, two steps equal the eager build's bit for bit (losses, weights, running statistics) on
    both ranks, and the dense step is one graph with no break: the batch norms' collectives are in it. 1 sample a
    rank, at most 2,000 pillars a cloud."""
    out = tmp_path / "capture_sync_bn.json"
    result = torchrun(2, WORKERS / "capture_sync_bn_worker.py", "--toy", toy_small, "--out", out, ATTFUSE)
    assert result.returncode == 0, explain(result)
    report = json.loads(out.read_text())
    same = {"losses_equal": [True, True], "states_equal": [True, True], "graphs": [1, 1], "graph_breaks": [0, 0]}
    assert report == {"aot_eager": same, "cudagraphs": same}, report


@pytest.mark.parametrize("config, overrides", [
    ("toy/point_pillar_early_fusion", ()),
    ("toy/point_pillar_late_fusion", ()),
    ("toy/point_pillar_intermediate_fusion", ()),
    ("toy/point_pillar_fcooper", ()),
    ("toy/point_pillar_cobevt", ()),
    ("toy/point_pillar_where2comm", ()),
    ("toy/point_pillar_v2vnet", ()),
    ("toy/point_pillar_intermediate_fusion", ("fusion.args.proj_first=false",)),
    ("toy/point_pillar_fcooper", ("fusion.args.proj_first=false",)),
    ("toy/point_pillar_cobevt", ("fusion.args.proj_first=false",)),
    ("toy/point_pillar_where2comm", ("fusion.args.proj_first=false",)),
    ("toy/point_pillar_v2vnet", ("fusion.args.proj_first=false",)),
    ("toy/second_intermediate_fusion", ()),
    ("toy/second_intermediate_fusion", ("fusion.args.proj_first=false",)),
], ids=["early", "late", "attfuse", "fcooper", "cobevt", "where2comm", "v2vnet", "attfuse-warped", "fcooper-warped",
        "cobevt-warped", "where2comm-warped", "v2vnet-warped", "second", "second-warped"])
def test_the_captured_graphs_hold_no_host_tensor(toy_small, config, overrides):
    """On a GPU a graph with a host tensor anywhere in it is not replayed as a CUDA graph: the cudagraphs backend
    looks at every node of the forward and backward graphs ("skipping cudagraphs due to cpu device"), inductor at
    its inputs, and the step keeps its launches; a host tensor read inside a graph is also a copy to the device
    there. The batch keeps record_len and the pairwise matrices on the host (data/device_points.HOST_KEYS), so the
    model's layout must send the graph what it derives from them, and no constant may be made on the host. The meta
    device stands for the GPU: the batch goes there through the task's own move_to, a backend records AOTAutograd's
    forward and backward graphs (what both modes replay), and every node of both must be on meta, and neither may give
engine/cuda_graphs.py a reason not to replay it. (V2X-ViT is not
    here: dynamo makes its constants real meta tensors, which its fake tensors refuse; on a GPU they are constants
    of the graph, and its agents' rows go to the maps' device in its layout. SECOND's front is spconv's, which has
    no meta kernels: it runs on the host, and its map goes to meta for the dense part.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.cudagraphs import get_device_node_mapping
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.utils import count_tangents

    from opencood_ddp.engine import capture
    from opencood_ddp.engine.cuda_graphs import skip_reason, static_inputs
    from opencood_ddp.tasks import build_task

    meta = torch.device("meta")
    devices = []  # (graph, {device: its first node}) per AOTAutograd graph compiled
    reasons = []  # (graph, why engine/cuda_graphs.py would not replay it: None when it would)

    def record(kind, graph_module, static):
        devices.append((kind, {str(device): node.name
                               for device, node in get_device_node_mapping(graph_module).items()}))
        reasons.append((kind, skip_reason(graph_module, static, devices=False)))  # meta: the check above

    def backend(graph_module, dynamo_inputs):
        """--capture cudagraphs' graphs (engine/cuda_graphs.py: the buffers' updates kept in them), recorded."""
        def forward(aot_graph, aot_inputs):
            record("forward", aot_graph, static_inputs(len(dynamo_inputs), len(aot_inputs)))
            return boxed_nop(aot_graph, aot_inputs)

        def backward(aot_graph, aot_inputs):
            record("backward", aot_graph, range(count_tangents(aot_graph)))
            return boxed_nop(aot_graph, aot_inputs)
        return aot_autograd(fw_compiler=forward, bw_compiler=backward,
                            keep_inference_input_mutations=True)(graph_module, dynamo_inputs)

    torch.manual_seed(0)
    task = build_task(hypes_of(config, *overrides, toy_root=toy_small), for_training=True)
    batch, model = task.collate_train([task.train_set[i] for i in range(2)]), task.model.train()
    if "second" in config:  # the front on the host (the docstring), the dense part's input on meta
        with cuda_kernels_on_cpu():
            features = model.front(batch["ego"]).detach().to(meta).requires_grad_()
    batch, model = task.move_to(batch, meta), model.to(meta)
    if "second" not in config:
        features = model.front(batch["ego"])
    layout = capture.captured_layout(model.layout(batch["ego"]))
    out = torch.compile(capture.dense_step, backend=backend, dynamic=False)(task.step, model, features, layout, batch)
    out.total.backward()
    assert out.total.device == meta
    # one graph each way (no graph break), every node on meta
    assert sorted(kind for kind, _ in devices) == ["backward", "forward"], devices
    assert all(set(found) == {"meta"} for _, found in devices), devices
    # and with meta for the GPU, the capture's backend finds no reason not to replay either graph: no write to an
    # input that is not a weight or buffer (the batch norms' updates stay in the forward graph), no op a CUDA
    # graph cannot hold
    assert reasons == [("forward", None), ("backward", None)], reasons


class TinyDeblock(nn.Module):
    """The seam around the kind of layer inductor's layout optimization broke on an H200: a convolution, then a
    stride-4 ConvTranspose2d as the backbone's last deblock, 128 channels in and out."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 128, 3, padding=1)
        self.deblock = nn.ConvTranspose2d(128, 128, 4, stride=4)

    def front(self, ego):
        return ego["maps"]

    def layout(self, ego):
        return {"record_len": ego["record_len"]}

    def dense(self, features, layout):
        return {"score": self.deblock(self.conv(features).relu()).flatten(1).mean(1)}

    def forward(self, ego):
        return self.dense(self.front(ego), self.layout(ego))


def test_compile_keeps_the_eager_layouts_of_the_convolutions():
    """--capture compile passes inductor no layout optimization (`inductor_options`), which reaches both graphs:
    the forward's, compiled on the first call, and the backward's, compiled later outside that call. On the CPU
    inductor would choose channels-last for any graph with a convolution (its own heuristic), so this compile
    shows the option at work; inductor re-rounds, so the step matches eager's to float32's rounding."""
    import torch._inductor.graph as inductor_graph

    from opencood_ddp.engine.capture import inductor_options
    from opencood_ddp.engine.task import LossOutput

    assert inductor_options(False) == {"layout_optimization": False}
    assert inductor_options(True) == {"triton.cudagraphs": True, "layout_optimization": False}

    def step(model, batch):
        return LossOutput(model(batch["ego"])["score"].square().sum(), {})

    torch.manual_seed(0)
    batch = {"ego": {"maps": torch.randn(2, 4, 8, 8), "record_len": torch.tensor([1, 1])}}
    eager, model = TinyDeblock(), TinyDeblock()
    model.load_state_dict(eager.state_dict())
    decisions = []
    decide = inductor_graph.GraphLowering.decide_layout_opt  # the real heuristic runs; its answers are recorded

    def recorded(*args, **kwargs):
        decisions.append(decide(*args, **kwargs))
        return decisions[-1]

    inductor_graph.GraphLowering.decide_layout_opt = staticmethod(recorded)
    # no cached graph: a cache hit (this test's own graphs from an earlier run) lowers nothing, decides nothing
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        with no_caches[0], no_caches[1]:
            expected, got = step(eager, batch), CaptureModule(model, step, "compile", CPU)(batch)
            expected.total.backward()
            got.total.backward()
    finally:
        inductor_graph.GraphLowering.decide_layout_opt = staticmethod(decide)
    assert decisions == [False, False]  # forward and backward graphs
    assert got.total.item() == pytest.approx(expected.total.item(), rel=1e-5)
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
