#!/usr/bin/env python
"""The GPU acceptance run (`make gpu-check`): one command on one GPU, about 10 minutes, exit 1 on any failure.
`--device cpu` runs the same path on the CPU (`make test` runs a part of it, so that it cannot rot). Writes
gpu_check.json (every figure) and gpu_check.md (the tables docs/benchmarks.md and docs/model_zoo.md take) into --out.

    python tools/gpu_check.py [--device cuda|cpu] [--out gpu_check] [--work DIR] [--configs toy/x ...]
        [--precisions fp32 ...]

Checks, each ok / failed / skipped with the reason:
- device: the device this process gets from the launcher's environment (distributed/devices.py);
- process_group: NCCL (gloo on the CPU) at world size 1 on `cuda:<index>`, an all_reduce on the device, and the
  gloo control group the control plane runs on;
- sync_batchnorm: torch's SyncBatchNorm (our GlooSyncBatchNorm on the CPU) equal to BatchNorm at world size 1;
- spconv: spconv's sparse convolution on the device (SECOND needs it), or "no CUDA spconv for this torch";
- train/resume/eval, for each config (the nine toy models, then the full-size OPV2V AttFuse) and each precision
  (fp32, fp16 = `--half fp16`, bf16 = `--half bf16`): 2 optimizer steps (`--max_steps 2`), a resume of that run to
  the end of its epoch, and the evaluation of the epoch's checkpoint (`--eval_after_training`), each through the
  tools' own entry (`engine.train.main`) in this process; samples/s of the resumed steps and the peak memory
  (reserved and allocated) of the whole; then the step alone (the trainer's, on a batch already on the device)
  at per-GPU batch 1 and 2, and the rate its FLOPs (torch's FlopCounterMode, engine/census.py) make beside the
  device's published peak, and the step at batch 1 in DDP as the trainer wraps it on N ranks, here at world size 1
  (NCCL on CUDA: the floor of what DDP adds on N GPUs; a one-rank run trains without DDP) (issue 52);
- cpu_weights: a weights file written on the device opened by `torch.load` without map_location (as upstream's
  loader does) in a process that sees no GPU;
- repeat: the models that warp feature maps (V2VNet, V2X-ViT, CoBEVT) trained twice for 2 steps with
  `--deterministic --no_tf32`, which must end with the same weights bit for bit (torch's grid_sample has no
  deterministic CUDA backward; modules/grid_sampling.py stands in for it);
- parity: 2 processes sharing the device over gloo (OPENCOOD_DDP_SHARE_GPUS=1) against 1 process, by
  tools/parity_check.py (its measured noise floor), with torch's default kernels and with
  `--deterministic --no_tf32`;
- planner: engine/batch_fit's prediction for per-GPU batch 4, fitted on batches 1 and 2, beside the measured
  peak at 4 (reserved and allocated), on the full-size AttFuse;
- loader: how many DataLoader workers one rank needs to keep its device busy, on the full-size AttFuse: the
  training step's samples/s on a batch already on the device, beside the training loader's samples/s (the
  trainer's own loader: persistent workers, pinned memory on CUDA; each batch moved to the device by the task's
  move_to, which under preprocess.on_device does the point work and the labels there) at 0, 1, 2, 4, 8 and 12
  workers, as many as this process has cores, and the count the default rule gives here (engine/loaders.py
  `workers_per_rank`), for each data path of `--loader_paths`: the CPU path on ascii clouds, on binary clouds (the
  world's binary mirror, tools/convert_pcd.py's), and `preprocess.on_device` on binary clouds. It reads its own toy
  world, `--loader_scale dense` by default: OPV2V-size clouds (about 90k points; the small world's have 8k), so
  that the count holds for OPV2V;
- feed: a tools/train_ddp.py run of the full-size AttFuse on the device path (`preprocess.on_device`, the loader
  check's world in binary, `--feed_workers` loader workers): its samples/s over the steps after the first epoch,
  beside the step alone on a batch already on the device (issue 51 asks for 90 %);
- voxelizer: the device path's pillars (data/sorted_voxels.py) on the device against the same code on the CPU,
  bit for bit, on an OPV2V-size cloud; and whether spconv's voxelizer on the device gives the same voxels in the
  same order twice, and the CPU generator's voxels (reported to depend on its threads' timing);
- host_syncs (CUDA only), for each config: a training step under torch.cuda.set_sync_debug_mode("error") after a
  warm-up, which must read nothing back from the GPU in forward, loss, backward and the fused optimizer update
  (issue 52; SECOND's spconv reads its voxel count back by design, reported);
- capture_accumulation, for each of `--capture_configs`: tools/train_ddp.py's first 2 steps under --capture (the
  first of `--capture_modes`) with the batch of 2 accumulated in micro-batches of 1, one process without DDP, and
  the same run eager: the fit loop's accumulation through CUDA graphs, whose gradients the next replay overwrites
  unless the loop copies them out (engine/capture.py);
- capture and capture_ddp, for each of `--capture_configs` (the full-size AttFuse) and `--capture_modes`; last,
  since inductor compiles for minutes: the trainer's step under `--capture` beside the eager step at per-GPU batch
  1 and 2, from the same weights on the same batch, then both at batch 1 in DDP at world size 1 (2 GPUs at batch 1
  against 1 at batch 2; a check of its own, so that a failure of collectives in CUDA graphs keeps the first's
  figures): the steps' ms, the speed-ups, the first losses' relative gaps to eager's and the graphs not replayed
  as CUDA graphs, with torch's reasons. On CUDA `cudagraphs` (the eager kernels replayed as CUDA graphs) then
  `compile` (inductor with CUDA graphs); on the CPU `cudagraphs`, whose graphs run on the eager kernels there, so
  its first losses must be eager's bit for bit (issue 52 item 3).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import io
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from opencood_ddp.engine.capture import CAPTURE_MODES, TIMING_WARMUPS
from opencood_ddp.toy.config import SCALES, split_overrides, split_set_flags

REPO = Path(__file__).resolve().parents[1]
TOY_CONFIGS = [f"toy/{name}" for name in (
    "point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
    "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt",
    "point_pillar_where2comm", "second_early_fusion", "second_late_fusion", "second_intermediate_fusion")]
FULL_SIZE = "opv2v/point_pillar_intermediate_fusion"
PRECISIONS = {"fp32": [], "fp16": ["--half", "fp16"], "bf16": ["--half", "bf16"]}
LOADER_WORKERS = (0, 1, 2, 4, 8, 12)  # the worker counts the loader check tries, up to the process's cores
# The loader check's data paths: (cloud format, preprocess.on_device).
LOADER_PATHS = {"ascii": ("ascii", False), "binary": ("binary", False), "on_device": ("binary", True)}
PARITY_KERNELS = {"default": "", "strict": "--deterministic --no_tf32"}  # training flags of each parity run
# The models whose feature warps go through modules/grid_sampling.py (the ego warp of proj_first: false configs
# runs the same function): their --deterministic runs must repeat bit for bit.
REPEAT_CONFIGS = [f"toy/{name}" for name in ("point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt")]
SPARSE_CONFIGS = ("second",)  # configs that need spconv's kernels on the device
STEP_BATCHES = (1, 2)  # the per-GPU batches of the model table's step times and rates (issue 52)
# --capture's modes of the capture check on CUDA: the eager kernels replayed as CUDA graphs (a compile of seconds)
# first, then inductor's (minutes)
CAPTURE_CHECK_MODES = ("cudagraphs", "compile")


@dataclass
class Check:
    name: str
    status: str  # ok, failed, skipped
    seconds: float
    detail: str = ""
    figures: dict = field(default_factory=dict)


class SkipCheck(Exception):
    pass


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="gpu_check", help="folder of the report (created)")
    parser.add_argument("--work", help="folder of the toy worlds and the runs' folders (default: --out). A lent "
                                       "device machine returns only a few files from its output folder, so the "
                                       "report goes there and the work elsewhere")
    parser.add_argument("--configs", nargs="*", default=TOY_CONFIGS, help="hypes under hypes_yaml/, without .yaml")
    parser.add_argument("--full_size", nargs="*", default=[FULL_SIZE],
                        help="full-size configs trained on the toy world's frames (none: leave out)")
    parser.add_argument("--precisions", nargs="+", choices=sorted(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--parity_config", default="toy/point_pillar_intermediate_fusion",
                        help="config of the 2-process parity check ('none': leave it out)")
    parser.add_argument("--parity_kernels", nargs="+", choices=list(PARITY_KERNELS), default=list(PARITY_KERNELS),
                        help="parity with torch's default kernels, and with --deterministic --no_tf32 (strict)")
    parser.add_argument("--repeat_configs", nargs="*", default=REPEAT_CONFIGS,
                        help="configs trained twice with --deterministic --no_tf32, which must repeat bit for bit")
    parser.add_argument("--capture_configs", nargs="*", default=[FULL_SIZE],
                        help="configs of the --capture check (none: leave it out)")
    parser.add_argument("--capture_modes", nargs="+", choices=CAPTURE_MODES,
                        help=f"--capture modes of that check (default: {' '.join(CAPTURE_CHECK_MODES)} on CUDA, "
                             "cudagraphs on the CPU, where inductor compiles for minutes)")
    parser.add_argument("--sync_configs", nargs="*", default=TOY_CONFIGS,
                        help="configs whose training step must read nothing back from the GPU (CUDA only)")
    parser.add_argument("--planner_config", default=FULL_SIZE, help="config of the planner check ('none': leave out)")
    parser.add_argument("--loader_config", default=FULL_SIZE, help="config of the loader check ('none': leave out)")
    parser.add_argument("--loader_paths", nargs="+", choices=list(LOADER_PATHS), default=list(LOADER_PATHS),
                        help="the data paths the loader check measures (module docstring)")
    parser.add_argument("--feed_config", default=FULL_SIZE, help="config of the feed check ('none': leave out)")
    parser.add_argument("--feed_workers", type=int, default=4, help="loader workers of the feed check's run")
    parser.add_argument("--feed_steps", type=int, default=40, help="optimizer steps of the feed check's run")
    parser.add_argument("--loader_scale", choices=SCALES, default="dense",
                        help="toy world the loader check reads when --data is not given (dense: OPV2V-size clouds, "
                             "so that the worker count it reports holds for OPV2V)")
    parser.add_argument("--scale", choices=SCALES, default="small",
                        help="toy world of the synthetic frames (small: 8 training, 4 test frames)")
    parser.add_argument("--data", help="toy world folder (default: one under --work, generated)")
    return parser.parse_args(argv)


def timed(name: str, action: Callable[[], tuple[str, dict]]) -> Check:
    """Run one check: (detail, figures) is ok; SkipCheck skips it; any other exception fails it, with its last
    lines kept in the report."""
    started = time.perf_counter()
    try:
        detail, figures = action()
        status = "ok"
    except SkipCheck as skip:
        status, detail, figures = "skipped", str(skip), {}
    except Exception as exc:  # noqa: BLE001  a check reports what broke; the others still run
        status, figures = "failed", {}
        detail = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc().splitlines(True)[-6:])
    check = Check(name, status, round(time.perf_counter() - started, 2), detail.strip(), figures)
    first = check.detail.splitlines()[0] if check.detail else ""
    print(f"{check.status:8s} {check.name} ({check.seconds:.1f} s){': ' + first if first else ''}", flush=True)
    return check


# ------------------------------------------------------------------------------------------ in-process checks
def check_device(device: torch.device) -> tuple[str, dict]:
    from opencood_ddp.distributed.env import detect_dist_env

    env = detect_dist_env(os.environ, cuda_available=device.type == "cuda")
    assert env.device.startswith(device.type), env.describe()
    return env.describe(), {"device": env.device, "processes_on_device": env.processes_on_device}


def _one_rank_group(device: torch.device):
    """A world-size-1 group as init_distributed_mode opens one: NCCL bound to the device with its index (torch
    refuses a device_id without one), and the control plane's gloo group beside it."""
    import torch.distributed as dist

    from opencood_ddp.distributed import comm

    kwargs = {}
    if device.type == "cuda":
        device = with_index(device, torch.cuda.current_device())
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, **kwargs)
    comm.open_control_group(datetime.timedelta(minutes=2))
    return dist, comm


def with_index(device: torch.device, current: int) -> torch.device:
    """`device` with its index (`current` when it has none): init_process_group refuses a device_id without one
    ("Please use a device_id with index"), and `--device cuda` names none."""
    return device if device.index is not None or device.type != "cuda" else torch.device(device.type, current)


def _close_group(dist, comm) -> None:
    comm.close_control_group()
    dist.destroy_process_group()


def check_process_group(device: torch.device) -> tuple[str, dict]:
    dist, comm = _one_rank_group(device)
    try:
        value = torch.arange(4, dtype=torch.float32, device=device)
        dist.all_reduce(value)
        assert value.tolist() == [0.0, 1.0, 2.0, 3.0], value
        error, flags = comm.agree(None, flags=[1.0])
        assert error is None and flags == [1.0]
        control = "a gloo control group" if comm.control_group() is not None else "the default group for control"
        return (f"{dist.get_backend()} at world size 1, all_reduce on {value.device}; {control}",
                {"backend": dist.get_backend(), "control_group": comm.control_group() is not None})
    finally:
        _close_group(dist, comm)


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 4, 1))


def check_sync_batchnorm(device: torch.device) -> tuple[str, dict]:
    from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm

    dist, comm = _one_rank_group(device)
    try:
        plain = _bn_net().to(device)
        synced, kind = convert_sync_batchnorm(_bn_net(), world_size=2, device=str(device))  # the multi-rank path
        synced = synced.to(device)
        x = torch.randn(4, 3, 16, 16, device=device)
        outputs = []
        for net in (plain, synced):
            out = net(x)
            out.square().mean().backward()
            outputs.append((out.detach(), net[0].weight.grad.detach()))
        gap = max((a - b).abs().max().item() for a, b in zip(outputs[0], outputs[1]))
        assert gap < 1e-4, f"{kind} differs from BatchNorm at world size 1 by {gap}"
        return f"{kind}: forward and backward equal BatchNorm at world size 1 (max gap {gap:.1e})", {"kind": kind}
    finally:
        _close_group(dist, comm)


def check_spconv(device: torch.device) -> tuple[str, dict]:
    """spconv's sparse convolution on the device: SECOND's kernels. A wheel whose kernels do not run here is a
    skip that says so, never an ok."""
    import importlib.metadata as metadata

    wheels = [f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
              if d.metadata["Name"].lower().startswith("spconv")]
    works = sparse_conv_runs(device)
    if works != "yes":
        raise SkipCheck(f"no {device.type.upper()} spconv for this torch ({', '.join(wheels) or 'no spconv wheel'}: "
                        f"{works}); SECOND is not checked")
    return f"{', '.join(wheels)}: a submanifold convolution ran on {device}", {"spconv": wheels}


def sparse_conv_runs(device: torch.device) -> str:
    """'yes', or why not."""
    try:
        import spconv.pytorch as spconv

        coords = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2]], dtype=torch.int32, device=device)
        features = torch.ones(2, 4, device=device)
        tensor = spconv.SparseConvTensor(features, coords, [4, 4, 4], 1)
        out = spconv.SubMConv3d(4, 8, 3, indice_key="k").to(device)(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return "yes" if out.features.shape == (2, 8) else f"unexpected shape {tuple(out.features.shape)}"
    except Exception as exc:  # noqa: BLE001  reported as the reason SECOND is skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


# ------------------------------------------------------------------------------------------ the trainings
@contextlib.contextmanager
def _entry_sandbox(device: torch.device):
    """A tool's main in this process (engine/entry.py's sandbox): the launcher variables out of its environment,
    no GPU on the CPU run, its output kept apart."""
    from opencood_ddp.distributed.env import environ_without_launcher
    from opencood_ddp.engine.entry import entry_sandbox

    environ = environ_without_launcher(os.environ)
    if device.type == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""
    out = io.StringIO()
    with entry_sandbox(environ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield out


def run_training(argv: list, device: torch.device) -> None:
    """tools/train_ddp.py's main on `argv`, in this process; a non-zero exit is an error with the run's output."""
    from opencood_ddp.engine.train import main
    from opencood_ddp.tasks import build_eval, build_task

    with _entry_sandbox(device) as out:
        code = main([str(a) for a in argv], build_task, build_eval)
    if code != 0:
        raise RuntimeError(f"train_ddp {' '.join(map(str, argv[:4]))} ... exit {code}\n{out.getvalue()[-2000:]}")


class Peak:
    """Peak memory of a stretch of work: CUDA's reserved and allocated bytes, the resident set on the CPU."""

    def __init__(self, device: torch.device):
        from opencood_ddp.engine.memory import PeakMemory

        self.meter = PeakMemory(device)

    def __enter__(self):
        if self.meter.device.type == "cuda":
            # The caching allocator keeps what the previous check's run reserved: without this, the reserved peak
            # of each check included its predecessors' (the first H200 run's column only ever grew).
            gc.collect()
            torch.cuda.empty_cache()
        self.meter.start()
        return self

    def __exit__(self, *exc):
        return False

    def mib(self) -> dict:
        return {"peak_reserved_mib": round(self.meter.peak() / 2 ** 20, 1),
                "peak_allocated_mib": round(self.meter.peak_allocated() / 2 ** 20, 1)}


def train_two_steps(config: str, run_dir: Path, data: Path, flags: Sequence[str], device: torch.device) -> Path:
    """tools/train_ddp.py's 2 first optimizer steps of `config` on the toy world `data`, loading in this process
    (`--max_steps 2`); the weights it saves, net_step2.pth."""
    run_training(["--hypes_yaml", REPO / "hypes_yaml" / f"{config}.yaml", "--model_dir", run_dir,
                  "--set", "train_params.epoches=1", "--max_steps", "2", "--num_workers", "0", *flags,
                  *split_set_flags(data)], device)
    weights = run_dir / "net_step2.pth"
    assert weights.is_file(), f"no net_step2.pth in {run_dir}"
    return weights


def needs_sparse_conv(config: str) -> bool:
    return any(name in config for name in SPARSE_CONFIGS)


def skip_without_sparse_conv(config: str, device: torch.device) -> None:
    """SkipCheck for a config that needs spconv's kernels on a device this torch's spconv lacks."""
    if needs_sparse_conv(config) and sparse_conv_runs(device) != "yes":
        raise SkipCheck(f"no {device.type.upper()} spconv for this torch: {config} needs its sparse convolution")


def check_training(config: str, precision: str, device: torch.device, data: Path, work: Path) -> tuple[str, dict]:
    """2 steps, a resume to the end of the epoch, the evaluation of its checkpoint; samples/s and peak memory; then
    the step alone at batch 1 and 2 and its rate (`step_rates`, outside the peak-memory stretch)."""
    from opencood_ddp.engine.logs import STEP_LOG_NAME, read_step_log

    skip_without_sparse_conv(config, device)
    run_dir = work / f"{config.replace('/', '_')}_{precision}"
    started = time.perf_counter()
    with Peak(device) as peak:
        train_two_steps(config, run_dir, data, PRECISIONS[precision], device)
        run_training(["--model_dir", run_dir, "--eval_after_training", "--num_workers", "0", *PRECISIONS[precision],
                      *split_set_flags(data)], device)
    rows = read_step_log(run_dir / STEP_LOG_NAME)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) > 2, \
        f"the resumed run did not go on from step 2: steps {[r['step'] for r in rows]}"
    losses = [r["loss"] for r in rows]
    assert all(map(_finite, losses)), f"non-finite loss: {losses}"
    result = _read_yaml(run_dir / "eval.yaml")
    resumed = rows[2:]
    rate = sum(r["samples_per_s"] for r in resumed) / len(resumed)
    figures = {"steps": len(rows), "losses": [round(x, 4) for x in losses], "samples_per_s": round(rate, 2),
               "ap_50": result["ap_50"], "frames": result["frames"], "seconds": round(time.perf_counter() - started, 1),
               "weights": str(run_dir / "net_epoch1.pth"), **peak.mib(), **step_rates(config, precision, device, data)}
    scaler = ""
    if "scaler_skipped" in rows[0]:  # fp16: how many of its steps the GradScaler skipped (the step log says)
        figures["scaler_skips"] = int(sum(r["scaler_skipped"] for r in rows))
        scaler = f", {figures['scaler_skips']} of them skipped by the GradScaler"
    return (f"{len(rows)} steps (2, then resumed){scaler}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {rate:.1f} "
            f"samples/s, peak {figures['peak_reserved_mib']} MiB reserved; eval AP@0.5 {result['ap_50']:.3f} on "
            f"{result['frames']} frames; the step alone {figures['step_ms_b1']} ms at batch 1, "
            f"{figures['step_ms_b2']} ms at 2 ({figures['tflops_b2']} TFLOP/s), "
            f"{figures['ddp_step_ms_b1']} ms at batch 1 in DDP at world size 1"), figures


def check_repeatable(config: str, device: torch.device, data: Path, work: Path) -> tuple[str, dict]:
    """Two runs of 2 steps with --deterministic --no_tf32 end with the same weights, bit for bit. The configs
    are the models that warp feature maps: torch has no deterministic CUDA backward for grid_sample, and
    modules/grid_sampling.py's gathers stand in for it under the flag."""
    states = []
    for attempt in (1, 2):
        run_dir = work / f"repeat_{config.replace('/', '_')}_{attempt}"
        weights = train_two_steps(config, run_dir, data, PARITY_KERNELS["strict"].split(), device)
        states.append(torch.load(weights, map_location="cpu", weights_only=True))
    differ = [name for name in states[0] if not torch.equal(states[0][name], states[1][name])]
    if differ:
        raise RuntimeError(f"{PARITY_KERNELS['strict']} trained different weights twice: {len(differ)} of "
                           f"{len(states[0])} tensors differ ({', '.join(differ[:3])}, ...)")
    return (f"2 runs of 2 steps with {PARITY_KERNELS['strict']}: all {len(states[0])} tensors bit-equal",
            {"tensors": len(states[0])})


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def check_cpu_weights(weights: Path) -> tuple[str, dict]:
    """Upstream's load_saved_model calls torch.load without map_location: a file of CUDA tensors would not open on
    a host without a GPU. Opened here in a process that sees none."""
    code = ("import sys, torch; s = torch.load(sys.argv[1], weights_only=True); "
            "print(len(s), sorted({str(v.device) for v in s.values()}))")
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", code, str(weights)], capture_output=True, text=True, env=environ,
                            timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{weights} does not open without a GPU:\n{result.stderr[-1500:]}")
    return f"{weights.name} opens without map_location on a process without GPU: {result.stdout.strip()}", {}


def check_parity(config: str, device: torch.device, data: Path, work: Path, kernels: str) -> tuple[str, dict]:
    """tools/parity_check.py: 2 processes on the one device (gloo) against 1, judged by its measured noise floor;
    with the kernels users train with, then with deterministic IEEE-float32 ones. On an H200 the default kernels
    put the floor of 4 toy steps at 7.1e-3 (loss) and 8.9e-3 (weights), the CPU's at 2e-7, and --deterministic
    alone left it unchanged; the strict run says how much of the floor TF32 convolutions make."""
    from opencood_ddp.distributed.devices import SHARE_GPUS_VARIABLE
    from opencood_ddp.distributed.env import environ_without_launcher

    environ = environ_without_launcher(os.environ)
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{SHARE_GPUS_VARIABLE: "1"})
    if device.type == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, REPO / "tools" / "parity_check.py", "--hypes_yaml",
               REPO / "hypes_yaml" / f"{config}.yaml", "--world_sizes", "2", "--steps", "4",
               "--train_args", f"--dist_backend gloo {PARITY_KERNELS[kernels]}", "--work_dir",
               work / f"parity_{kernels}", "--timeout", "600"]
    command += split_set_flags(data)
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=environ, cwd=REPO,
                            timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"parity_check exit {result.returncode}:\n{(result.stdout + result.stderr)[-2000:]}")
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    # the table's rows only: the runs' progress lines ("world1_reversed_step4: done in 10 s") share the names
    rows = [" ".join(line.split()) for line in lines
            if line.split("|")[0].strip() in ("world2", "world1_reversed", "world1_rotated")]
    return (f"2 processes sharing {device} follow 1 ({kernels} kernels): {'; '.join(rows)} (samples/s, loss gap, "
            f"weight gap, step 4 gap, verdict)", {"report": lines[-8:]})


def check_planner(config: str, device: torch.device, data: Path) -> tuple[str, dict]:
    """The memory model of --per_gpu_batch auto, fitted on batches 1 and 2, against the measured peak at 4."""
    from opencood_ddp.engine import batch_fit
    from opencood_ddp.tasks import build_task
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    path = REPO / "hypes_yaml" / f"{config}.yaml"
    hypes = load_parsed_hypes(path, split_overrides(data))
    probes = batch_fit.measure(hypes, build_task, [1, 2, 4], device)
    model = batch_fit.fit(probes[:2])
    predicted, measured = model.fixed + model.per_sample * 4, probes[2]
    rows = {p.per_rank: {"reserved_mib": round(p.peak_bytes / 2 ** 20, 1),
                         "allocated_mib": round(p.allocated_bytes / 2 ** 20, 1),
                         "step_s": round(p.step_seconds, 3)} for p in probes}
    figures = {"probes": rows, "predicted_4_mib": round(predicted / 2 ** 20, 1),
               "ratio": round(predicted / max(measured.peak_bytes, 1), 3)}
    return (f"per-GPU batch 4: predicted {figures['predicted_4_mib']} MiB from batches 1 and 2, measured "
            f"{rows[4]['reserved_mib']} MiB reserved ({rows[4]['allocated_mib']} allocated); predicted / measured "
            f"{figures['ratio']}"), figures


def _trainer_step(task, hypes: dict, device: torch.device, batch_size: int, half: Optional[str] = None,
                  capture: Optional[str] = None, ddp: bool = False):
    """The step as the trainer takes it (engine/census.py's trainer_step: forward_backward, the hypes' optimizer
    with the device's kernels, optimizer_step), on one batch of `batch_size` already on the device. With `capture`
    (a --capture mode) the step is the trainer's under --capture, on a copy of the model: engine/capture.py's
    CaptureModule, its dense part compiled on its first call. With `ddp`, on a copy of the model with its batch
    norms synchronized as on N ranks, in DDP as the trainer wraps it (distributed/ddp.wrap_ddp; under `capture` DDP
    wraps the CaptureModule, as engine/trainer.py does): it needs a process group (`_one_rank_group`)."""
    from opencood_ddp.distributed.ddp import wrap_ddp
    from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
    from opencood_ddp.engine.capture import CapturedStep, CaptureModule
    from opencood_ddp.engine.census import trainer_step
    from opencood_ddp.engine.optim import build_optimizer
    from opencood_ddp.engine.step import Precision

    model = task.model.to(device).train()
    batch = task.move_to(task.collate_train([task.train_set[i % len(task.train_set)] for i in range(batch_size)]),
                         device)
    if capture is not None or ddp:
        model = copy.deepcopy(model)
    if ddp:  # the kind N ranks convert to (at world size 1 it normalises as BatchNorm does)
        model, _ = convert_sync_batchnorm(model, 2, device.type)
    step, module = task.step, model
    if capture is not None:
        step, module = CapturedStep(), CaptureModule(model, task.step, capture, device)
    if ddp:
        module = wrap_ddp(module)
    optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for=device)
    precision = Precision(half, device)
    return trainer_step(step, module, batch, optimizer, precision, precision.new_scaler())


def _steps_per_second(task, hypes: dict, device: torch.device, batch_size: int) -> float:
    """Training samples/s of the model alone, on one batch already on the device: median of 3 steps after a
    warm-up."""
    from opencood_ddp.engine.census import median_step_seconds

    return batch_size / median_step_seconds(_trainer_step(task, hypes, device, batch_size), device)


def step_rates(config: str, precision: str, device: torch.device, data: Path) -> dict:
    """The training step alone at per-GPU batch 1 and 2 (STEP_BATCHES; median of 3 after a warm-up, on a batch
    already on the device), its FLOPs (torch's FlopCounterMode over forward and backward, engine/census.py), the
    rate those make over the step time, the step at batch 1 in DDP at world size 1 (`ddp_step_ms`), and the device's
    published peak for the precision (None: unknown). The warm-up step is the one whose FLOPs are counted, and the
    CPU times one step, not 3: `make test` runs this on the CPU only to keep it working, and fp16 there is
    emulated, seconds a step."""
    from opencood_ddp.engine.census import count_flops, device_peak, step_seconds

    task, hypes = _task_of(config, data)
    figures = {}
    for batch_size in STEP_BATCHES:
        step = _trainer_step(task, hypes, device, batch_size, None if precision == "fp32" else precision)
        flops = count_flops(step)
        seconds = statistics.median(step_seconds(step, device, 3 if device.type == "cuda" else 1))
        figures[f"step_ms_b{batch_size}"] = round(seconds * 1e3, 2)
        figures[f"gflop_b{batch_size}"] = round(flops / 1e9, 2)
        figures[f"tflops_b{batch_size}"] = float(f"{flops / seconds / 1e12:.3g}")  # 3 digits: a CPU is slow
    figures["ddp_step_ms_b1"] = ddp_step_ms(task, hypes, device, None if precision == "fp32" else precision)
    peak = device_peak(device, precision)
    figures["peak_tflops"] = None if peak is None else f"{peak[0]:g} ({peak[1]})"
    return figures


def ddp_step_ms(task, hypes: dict, device: torch.device, half: Optional[str]) -> float:
    """The step at per-GPU batch 1 in DDP as the trainer wraps it on N ranks, in a world-size-1 group (NCCL on
    CUDA): DDP's forward, its hooks and its bucketed all-reduce added to the step, the floor of what N ranks add
    (issue 52: 2 GPUs at batch 1 against 1 GPU at batch 2, which trains without DDP). Not in it: the synchronized
    batch norms' collectives, which at world size 1 do not run. Median of 3 after a warm-up (1 on the CPU, as
    `step_rates`)."""
    from opencood_ddp.engine.census import median_step_seconds

    dist, comm = _one_rank_group(device)
    try:
        step = _trainer_step(task, hypes, device, 1, half, ddp=True)
        # its warm-up step also lets DDP rebuild its buckets, which it does after the first step
        return round(median_step_seconds(step, device, 3 if device.type == "cuda" else 1) * 1e3, 2)
    finally:
        _close_group(dist, comm)


def _loader_samples_per_second(task, device: torch.device, workers: int, batch_size: int) -> float:
    """samples/s of the trainer's training loader at `workers`, each batch moved to the device by the task's
    move_to as the trainer moves it, once every worker has delivered a batch (a run's persistent workers start
    once), over 4 batches per worker (4 in the main process)."""
    from opencood_ddp.engine.loaders import training_loader

    warm, timed_batches = max(workers, 1), 4 * max(workers, 1)
    indices = [i % len(task.train_set) for i in range((warm + timed_batches) * batch_size)]
    loader = training_loader(task.train_set, task.collate_train, workers, pin_memory=device.type == "cuda")
    loader.batch_sampler.use(0, [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)])
    batches = iter(loader)
    for _ in range(warm):
        task.move_to(next(batches), device)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(timed_batches):
        task.move_to(next(batches), device)
    _synchronize(device)
    elapsed = time.perf_counter() - started
    del batches, loader  # stops the workers
    return timed_batches * batch_size / elapsed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _task_of(config: str, data: Path, on_device: bool = False):
    """(the trainer's task, its hypes) of `config` over `data`; the device path where `on_device` (off is the
    hypes' default, so the config is read as written)."""
    from opencood_ddp.tasks import build_task
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    overrides = split_overrides(data) + (["preprocess.on_device=true"] if on_device else [])
    hypes = load_parsed_hypes(REPO / "hypes_yaml" / f"{config}.yaml", overrides)
    return build_task(hypes, for_training=True), hypes


def check_loader(config: str, device: torch.device, data: Path, batch_size: int = 2,
                 paths: Sequence[str] = tuple(LOADER_PATHS)) -> tuple[str, dict]:
    """For each data path, the fewest DataLoader workers whose samples/s reach the training step's (LOADER_WORKERS,
    up to the cores)."""
    from opencood_ddp.data.pcd_convert import binary_mirror
    from opencood_ddp.engine.loaders import affinity_cores, default_workers

    cores = affinity_cores()
    task, hypes = _task_of(config, data)
    step_rate = _steps_per_second(task, hypes, device, batch_size)
    default = default_workers(device.type, cores)  # what a 1-rank run on this machine gets without --num_workers
    figures: dict = {"cores": cores, "step_samples_per_s": round(step_rate, 2), "batch_size": batch_size,
                     "default_workers": default, "paths": {}}
    roots = {"ascii": data, "binary": binary_mirror(data) if any(LOADER_PATHS[p][0] == "binary" for p in paths)
             else None}
    lines = []
    for path in paths:
        clouds, on_device = LOADER_PATHS[path]
        task, _ = _task_of(config, roots[clouds], on_device)
        rates = {workers: _loader_samples_per_second(task, device, workers, batch_size)
                 for workers in LOADER_WORKERS if workers <= cores}
        enough = [workers for workers, rate in rates.items() if rate >= step_rate]
        figures["paths"][path] = {"loader_samples_per_s": {str(w): round(r, 2) for w, r in rates.items()},
                                  "workers_to_feed": enough[0] if enough else None}
        verdict = (f"{enough[0]} worker(s) keep it fed" if enough else
                   f"no worker count up to {max(rates)} keeps it fed on {cores} cores")
        lines.append(f"{path}: {'/'.join(f'{r:.1f}' for r in rates.values())} samples/s at "
                     f"{'/'.join(map(str, rates))} workers, {verdict}")
    return f"step {step_rate:.1f} samples/s; {'; '.join(lines)}; the default gives {default}", figures


def check_feed(config: str, device: torch.device, data: Path, work: Path, workers: int,
               steps: int) -> tuple[str, dict]:
    """train_ddp on the device path with `workers` loader workers: the median samples/s of its steps after the first
    epoch (train_steps.csv: loading, the device's part and the step) against the step alone."""
    from statistics import median

    from opencood_ddp.data.pcd_convert import binary_mirror
    from opencood_ddp.engine.logs import STEP_LOG_NAME, read_step_log

    binary = binary_mirror(data)
    task, hypes = _task_of(config, binary)
    batch = int(hypes["train_params"]["batch_size"])
    step_rate = _steps_per_second(task, hypes, device, batch)
    per_epoch = len(task.train_set) // batch
    run_dir = work / f"feed_{config.replace('/', '_')}"
    run_training(["--hypes_yaml", REPO / "hypes_yaml" / f"{config}.yaml", "--model_dir", run_dir,
                  "--set", "preprocess.on_device=true", "--set", f"train_params.epoches={steps // per_epoch + 1}",
                  "--max_steps", steps, "--num_workers", workers, *split_set_flags(binary)], device)
    rows = read_step_log(run_dir / STEP_LOG_NAME)
    later = [float(row["samples_per_s"]) for row in rows[per_epoch:]] or [float(rows[-1]["samples_per_s"])]
    rate = median(later)
    ratio = rate / step_rate
    figures = {"step_samples_per_s": round(step_rate, 2), "train_samples_per_s": round(rate, 2),
               "ratio": round(ratio, 3), "workers": workers, "steps": len(rows), "batch_size": batch,
               "data_share": round(median(float(r["data_seconds"]) / float(r["seconds"]) for r in rows[per_epoch:])
                                   if len(rows) > per_epoch else float("nan"), 3)}
    verdict = "at or above" if ratio >= 0.9 else "below"
    return (f"train_ddp on the device path with {workers} workers: {rate:.1f} samples/s over steps "
            f"{per_epoch + 1}-{len(rows)}, {ratio:.2f} of the step alone ({step_rate:.1f}): {verdict} issue 51's 0.9",
            figures)


def _voxels_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[key].cpu().view(torch.int32), b[key].cpu().view(torch.int32)) for key in a)


def check_voxelizer(device: torch.device, data: Path) -> tuple[str, dict]:
    """The sorted voxelizer on `device` against itself on the CPU (bit for bit), and spconv's voxelizer on `device`:
    whether it repeats itself, and whether it finds the CPU generator's voxels, on one OPV2V-size cloud."""
    from opencood_ddp.data.pcd import read_pcd
    from opencood_ddp.data.sorted_voxels import VoxelGrid, voxelize_groups
    from opencood_ddp.data.voxelize import Voxelizer

    cloud = torch.from_numpy(read_pcd(sorted(data.glob("train/*/*/*.pcd"))[0]))
    grid = VoxelGrid((0.4, 0.4, 4.0), (-140.8, -40.0, -3.0, 140.8, 40.0, 1.0), 32, 32000)
    group = torch.zeros(len(cloud), dtype=torch.long)
    on_cpu = voxelize_groups(cloud, group, 1, grid)
    on_device = voxelize_groups(cloud.to(device), group.to(device), 1, grid)
    figures = {"points": len(cloud), "voxels": len(on_cpu["voxel_coords"]),
               "sorted_device_equals_cpu": _voxels_equal(on_device, on_cpu)}
    if not figures["sorted_device_equals_cpu"]:
        raise AssertionError(f"the sorted voxelizer on {device} differs from the same code on the CPU")
    if device.type != "cuda":
        return f"sorted voxelizer on {device}: {figures['voxels']} pillars, equal to the CPU's", figures
    args = (grid.voxel_size, grid.lidar_range, grid.max_points_per_voxel, grid.max_voxels)
    spconv_cpu = Voxelizer(*args)(cloud.numpy())
    spconv_gpu = [Voxelizer(*args, device=device)(cloud.numpy()) for _ in range(2)]
    as_tensors = [{key: torch.from_numpy(value) for key, value in run.items()} for run in spconv_gpu]
    coords = [set(map(tuple, run["voxel_coords"].tolist())) for run in spconv_gpu]
    cpu_coords = spconv_cpu["voxel_coords"]
    same_order = cpu_coords.shape == spconv_gpu[0]["voxel_coords"].shape and \
        bool((spconv_gpu[0]["voxel_coords"] == cpu_coords).all())
    figures.update(spconv_cuda_repeats=_voxels_equal(as_tensors[0], as_tensors[1]),
                   spconv_cuda_same_pillars_as_cpu=coords[0] == set(map(tuple, cpu_coords.tolist())),
                   spconv_cuda_same_order_as_cpu=same_order)
    return (f"sorted voxelizer on {device}: {figures['voxels']} pillars, bit for bit the CPU's; spconv on {device}: "
            f"repeats itself {figures['spconv_cuda_repeats']}, the CPU's pillars "
            f"{figures['spconv_cuda_same_pillars_as_cpu']}, in its order {figures['spconv_cuda_same_order_as_cpu']}",
            figures)

def check_host_syncs(config: str, device: torch.device, data: Path) -> tuple[str, dict]:
    """A training step of `config` under torch.cuda.set_sync_debug_mode("error"), after a warm-up step: forward,
    loss and backward must not read anything back from the device (issue 52; on the CPU tests/test_host_syncs.py
    proves it on the meta device), and neither may the fused optimizer's update. SECOND's spconv reads its voxel
    count back by design: reported, not failed."""
    if device.type != "cuda":
        raise SkipCheck("torch's sync debug mode is CUDA's; tests/test_host_syncs.py runs the models on meta")
    skip_without_sparse_conv(config, device)
    sparse = needs_sparse_conv(config)
    task, hypes = _task_of(config, data)
    step = _trainer_step(task, hypes, device, batch_size=2)
    step()  # warm-up: lazy handles and kernels may wait
    torch.cuda.synchronize(device)
    figures = {"forward_backward": _first_sync(step.forward_backward), "optimizer": _first_sync(step.update)}
    if sparse and figures["forward_backward"] != "none" and "spconv" in figures["forward_backward"]:
        return f"spconv reads back, as designed: {figures['forward_backward']}", figures
    assert figures == {"forward_backward": "none", "optimizer": "none"}, f"the step waits for the device: {figures}"
    return "no read-back in forward, loss, backward or the optimizer's update", figures


def check_capture(config: str, mode: str, device: torch.device, data: Path) -> tuple[str, dict]:
    """--capture `mode`'s step beside the eager step at per-GPU batch 1 and 2 (issue 52 item 3), `_captured_steps`'
    figures. On CUDA the modes are CAPTURE_CHECK_MODES: `cudagraphs` (the eager kernels replayed as CUDA graphs: what
    the launches alone cost) and `compile` (inductor, CUDA graphs; it rounds anew, and docs/capture.md judges its
    accuracy against float64). On the CPU `cudagraphs` alone, which keeps the check's code working in `make test`
    (inductor compiles for minutes on a CPU): its graphs run on the eager kernels, so its first losses must be
    eager's bit for bit, and the backend skips CUDA graphs for the host."""
    figures = _captured_steps(config, mode, device, data, {f"b{b}": (b, False) for b in STEP_BATCHES})
    steps = ", ".join(f"batch {b}: {figures[f'captured_ms_b{b}']} ms against eager's {figures[f'eager_ms_b{b}']} "
                      f"({figures[f'speedup_b{b}']}x), first loss {figures[f'first_loss_gap_b{b}']:.3g} from eager's"
                      for b in STEP_BATCHES)
    return f"--capture {mode}: {steps}{_skips(figures)}", figures


def check_capture_ddp(config: str, mode: str, device: torch.device, data: Path, captured_ms_b2: Optional[float]
                      ) -> tuple[str, dict]:
    """The captured step at batch 1 in DDP as the trainer wraps it on N ranks, here at world size 1 (NCCL on CUDA;
    its batch norms synchronized, so on N GPUs their collectives are in the graphs), beside the eager step in DDP: 2
    GPUs at batch 1 against 1 GPU at batch 2 (which trains without DDP), the issue's 1.6x, is the capture check's
    step at batch 2 (`captured_ms_b2`, None when that check failed) over this one (an N-rank run adds the
    all-reduce's time over world size 1's). A check of its own, after the capture check: collectives inside CUDA
    graphs are new ground, and a failure here keeps that check's figures."""
    figures = _captured_steps(config, mode, device, data, {"ddp_b1": (1, True)})
    figures["two_at_b1_over_one_at_b2"] = None if captured_ms_b2 is None else \
        round(captured_ms_b2 / figures["captured_ms_ddp_b1"], 2)
    return (f"--capture {mode} in DDP (world size 1), batch 1: {figures['captured_ms_ddp_b1']} ms against eager's "
            f"{figures['eager_ms_ddp_b1']} ({figures['speedup_ddp_b1']}x), first loss "
            f"{figures['first_loss_gap_ddp_b1']:.3g} from eager's; so 2 GPUs at batch 1 against 1 at batch 2: "
            f"{figures['two_at_b1_over_one_at_b2']}x{_skips(figures)}"), figures


def _captured_steps(config: str, mode: str, device: torch.device, data: Path, steps: dict) -> dict:
    """For each key -> (per-GPU batch, in DDP) of `steps`: the trainer's step under --capture `mode` beside the eager
    step, both in DDP as the trainer wraps them on N ranks when asked (at world size 1), from the same weights on the
    same batch: their ms (after the first steps, the captured one's compiling, and TIMING_WARMUPS more of the captured
    step, since CUDA graph trees record a graph on a later call; then medians of 5 rounds in turns,
    engine/census.seconds_in_turns), the speed-up, the first loss's relative gap to eager's (on the CPU a mode of
    eager kernels must give it bit for bit), and the graphs not replayed as CUDA graphs, with torch's reasons."""
    from opencood_ddp.engine.capture import step_kernels
    from opencood_ddp.engine.census import cudagraph_skips, seconds_in_turns

    skip_without_sparse_conv(config, device)
    task, hypes = _task_of(config, data)
    figures: dict = {"mode": mode}
    repeats = 5 if device.type == "cuda" else 1

    dist, comm = _one_rank_group(device)
    try:
        # the kernels a captured step takes, for both sides (on CUDA its own)
        with step_kernels(device), cudagraph_skips() as skips:
            for key, (batch_size, ddp) in steps.items():
                # the captured step trains a copy of the model's weights, eager the task's own: made before it runs
                captured = _trainer_step(task, hypes, device, batch_size, capture=mode, ddp=ddp)
                eager = _trainer_step(task, hypes, device, batch_size, ddp=ddp)
                eager_loss, loss = eager().item(), captured().item()
                assert _finite(loss), f"non-finite first loss ({key}): {loss}"
                gap = abs(loss - eager_loss) / max(abs(eager_loss), 1e-30)
                # on the CPU a mode of eager kernels repeats eager's first loss; inductor rounds anew
                assert mode == "compile" or device.type == "cuda" or gap == 0, \
                    f"{mode}'s first loss {loss} ({key}) is not eager's {eager_loss}"
                for _ in range(TIMING_WARMUPS):
                    captured()
                seconds = seconds_in_turns({"eager": eager, "captured": captured}, device, repeats)
                figures.update({f"first_loss_gap_{key}": float(f"{gap:.3g}"),
                                f"eager_ms_{key}": round(seconds["eager"] * 1e3, 2),
                                f"captured_ms_{key}": round(seconds["captured"] * 1e3, 2)})
                figures[f"speedup_{key}"] = round(figures[f"eager_ms_{key}"] / figures[f"captured_ms_{key}"], 2)
    finally:
        _close_group(dist, comm)
    figures["cudagraph_skips"], figures["cudagraph_skip_reasons"] = skips.count, sorted(set(skips.reasons))
    return figures


def _skips(figures: dict) -> str:
    return (f"; cudagraphs skipped {figures['cudagraph_skips']} times: {figures['cudagraph_skip_reasons'][:1]}"
            if figures["cudagraph_skips"] else "")


def check_captured_accumulation(config: str, mode: str, device: torch.device, data: Path, work: Path
                                ) -> tuple[str, dict]:
    """tools/train_ddp.py's first 2 optimizer steps of `config` under --capture `mode`, the hypes' batch of 2 in
    micro-batches of 1 (`--per_gpu_batch 1`: the batch plan accumulates 2), in one process without DDP, as a
    1-GPU run trains: the fit loop's accumulation through the captured step. Where the graphs replay as CUDA
    graphs, a gradient is first the backward graph's output, in the graphs' memory, which the second
    micro-batch's replay overwrites (engine/capture.py's gradients_out_of_graphs copies it out before). The losses
    must be finite; the same run eager beside it gives each loss's relative gap (on CUDA `cudagraphs` takes the
    eager step's kernels, so its first loss should be eager's; on the CPU the eager run takes the CPU's own
    kernels, a captured one CUDA's: docs/capture.md)."""
    from opencood_ddp.engine.logs import STEP_LOG_NAME, read_step_log

    skip_without_sparse_conv(config, device)
    losses = {}
    with tempfile.TemporaryDirectory(dir=work) as runs:  # new run folders: an old one would be resumed
        for name, flags in (("eager", []), ("captured", ["--capture", mode])):
            run_dir = Path(runs) / name
            train_two_steps(config, run_dir, data, ["--set", "train_params.batch_size=2", "--per_gpu_batch", "1",
                                                    *flags], device)
            losses[name] = [row["loss"] for row in read_step_log(run_dir / STEP_LOG_NAME)]
    assert len(losses["captured"]) == 2 and all(map(_finite, losses["captured"])), losses
    gaps = [float(f"{abs(c - e) / max(abs(e), 1e-30):.3g}") for c, e in zip(losses["captured"], losses["eager"])]
    figures = {"mode": mode, "accumulation": 2, "losses": losses, "loss_gaps": gaps}
    return (f"--capture {mode}, 2 steps of 2 accumulated micro-batches in one process: losses "
            f"{', '.join(f'{x:.4f}' for x in losses['captured'])}, relative gaps to eager's {gaps}"), figures


def _first_sync(action: Callable[[], object]) -> str:
    """'none', or where the first synchronising call of `action` came from (torch raises it in 'error' mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        action()
        return "none"
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "site-packages/torch/" not in f.filename]
        where = f"{'/'.join(Path(frames[-1].filename).parts[-3:])}:{frames[-1].lineno}" if frames else "?"
        return f"{str(error).splitlines()[0][:120]} at {where}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ------------------------------------------------------------------------------------------ report
def environment(device: torch.device) -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
            "host": platform.node(), "cpus": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def model_table(checks: list[Check]) -> list[str]:
    """One row per trained config and precision: the figures docs/model_zoo.md's GPU columns take, and the step
    alone at batch 1 and 2 with the rate its FLOPs make beside the device's peak (issue 52)."""
    lines = ["| config | precision | status | samples/s | peak reserved MiB | peak allocated MiB | AP@0.5 (toy) | "
             "step ms, batch 1 | step ms, batch 2 | TFLOP/s, batch 1 | TFLOP/s, batch 2 | step ms, batch 1 in DDP "
             "(world size 1) | device peak TFLOP/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for check in checks:
        if not check.name.startswith("train "):
            continue
        _, config, precision = check.name.split(" ")
        f = check.figures
        steps = " | ".join(str(f.get(key, "")) for key in ("step_ms_b1", "step_ms_b2", "tflops_b1", "tflops_b2",
                                                            "ddp_step_ms_b1"))
        peak = f.get("peak_tflops") or ("-" if f else "")
        lines.append(f"| {config} | {precision} | {check.status} | {f.get('samples_per_s', '')} | "
                     f"{f.get('peak_reserved_mib', '')} | {f.get('peak_allocated_mib', '')} | {f.get('ap_50', '')} | "
                     f"{steps} | {peak} |")
    return lines


def write_report(out: Path, machine: dict, checks: list[Check]) -> None:
    (out / "gpu_check.json").write_text(json.dumps({"environment": machine, "checks": [asdict(c) for c in checks]},
                                                   indent=2))
    lines = ["# gpu_check", "", " ".join(f"{k}: {v};" for k, v in machine.items()), "",
             "| check | status | seconds | detail |", "|---|---|---:|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds} | {c.detail.splitlines()[0] if c.detail else ''} |"
              for c in checks]
    lines += ["", *model_table(checks)]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def ensure_data(args: argparse.Namespace, work: Path, scale: str) -> Path:
    """--data, or the toy world of `scale` under --work (generated once, kept between runs)."""
    from opencood_ddp.toy.writer import generate_toy_opv2v

    if args.data:
        return Path(args.data)
    data = work / f"toy_{scale}"
    generate_toy_opv2v(data, seed=0, scale=scale)
    return data


def run_checks(args: argparse.Namespace) -> list[Check]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}); pass --device cpu")
    if device.type == "cuda":
        device = with_index(device, torch.cuda.current_device())
    out, work = Path(args.out), Path(args.work or args.out)
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    machine = environment(device)
    checks: list[Check] = []

    def record(check: Check) -> None:
        # The report is rewritten after every check, so a run cut short by a time limit keeps what it measured.
        checks.append(check)
        write_report(out, machine, checks)

    data = ensure_data(args, work, args.scale)
    record(timed("device", lambda: check_device(device)))
    record(timed("process_group", lambda: check_process_group(device)))
    record(timed("sync_batchnorm", lambda: check_sync_batchnorm(device)))
    record(timed("spconv", lambda: check_spconv(device)))
    with tempfile.TemporaryDirectory(dir=work) as folder:
        runs = Path(folder)
        for config in [*args.configs, *args.full_size]:
            for precision in args.precisions:
                record(timed(f"train {config} {precision}", lambda c=config, p=precision: check_training(
                    c, p, device, data, runs)))
        trained = [c for c in checks if c.name.startswith("train ") and c.status == "ok"]
        if trained:
            weights = Path(trained[0].figures["weights"])
            record(timed("cpu_weights", lambda: check_cpu_weights(weights)))
        for config in args.repeat_configs:
            record(timed(f"repeat {config}", lambda c=config: check_repeatable(c, device, data, runs)))
        if args.parity_config != "none":
            for kernels in args.parity_kernels:
                record(timed(f"parity {args.parity_config} {kernels}", lambda k=kernels: check_parity(
                    args.parity_config, device, data, runs, k)))
    if args.planner_config != "none":
        record(timed(f"planner {args.planner_config}", lambda: check_planner(args.planner_config, device, data)))
    loader_data = ensure_data(args, work, args.loader_scale)
    if args.loader_config != "none":
        record(timed(f"loader {args.loader_config}",
                     lambda: check_loader(args.loader_config, device, loader_data, paths=args.loader_paths)))
    if args.feed_config != "none":
        record(timed(f"feed {args.feed_config}", lambda: check_feed(
            args.feed_config, device, loader_data, work, args.feed_workers, args.feed_steps)))
    record(timed("voxelizer", lambda: check_voxelizer(device, loader_data)))
    if device.type == "cuda":  # torch's sync debug mode is CUDA's; on the CPU tests/test_host_syncs.py proves it
        for config in args.sync_configs:
            record(timed(f"host_syncs {config}", lambda c=config: check_host_syncs(c, device, data)))
    capture_modes = args.capture_modes or (CAPTURE_CHECK_MODES if device.type == "cuda" else ("cudagraphs",))
    for config in args.capture_configs:  # the trainer's accumulation through the first (the cheapest) mode
        record(timed(f"capture_accumulation {config}",
                     lambda c=config: check_captured_accumulation(c, capture_modes[0], device, data, work)))
    for config, mode in itertools.product(args.capture_configs, capture_modes):  # last: inductor compiles for
        # minutes, and a run cut short keeps the checks before
        record(timed(f"capture {mode} {config}", lambda c=config, m=mode: check_capture(c, m, device, data)))
        at_b2 = checks[-1].figures.get("captured_ms_b2")
        record(timed(f"capture_ddp {mode} {config}",
                     lambda c=config, m=mode, b2=at_b2: check_capture_ddp(c, m, device, data, b2)))
    return checks


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    checks = run_checks(args)
    failed = [c.name for c in checks if c.status == "failed"]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed or skipped; report: "
          f"{Path(args.out) / 'gpu_check.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
