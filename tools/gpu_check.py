#!/usr/bin/env python
"""One command that proves the CUDA path (`make gpu-check`), or the same path on the CPU (`--device cpu`, run by
`make test` so that it cannot rot). Writes gpu_check.md and gpu_check.json into --out.

    python tools/gpu_check.py [--device cuda|cpu] [--out gpu_check] [--half] [--configs opv2v/x ...]

Checks, each ok / failed / skipped with the reason:
- process_group: NCCL (gloo on the CPU) initialised at world size 1, an all_reduce on the device;
- sync_batchnorm: torch's SyncBatchNorm conversion (our GlooSyncBatchNorm on the CPU) and a training step in that
  group, equal to plain BatchNorm at world size 1;
- half: fp16 autocast with a GradScaler through a few steps, the scaler saved and resumed (bf16 and no scaler on
  the CPU, which needs none);
- voxelizer: the data pipeline's spconv point-to-voxel generator on the installed spconv wheel, and spconv's sparse
  convolution on the device (what SECOND needs);
- for each opv2v baseline on full-size synthetic frames (the toy world read with the baseline's range, grid and
  model): one epoch of a few steps (tools/train_ddp.py), and the evaluation of that checkpoint on 1 process
  and on 2 processes sharing the one device over gloo (DDP-era collectives on the device's tensors), whose eval.yaml
  must be equal;
- memory: per model and per-GPU batch 1 and 2, a training step's time, samples/s and peak memory
  (`torch.cuda.max_memory_allocated`; the resident-set growth on the CPU), as tools/plan_batch.py measures.
Exit 0 when nothing failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
BASELINES = ["opv2v/point_pillar_early_fusion", "opv2v/point_pillar_late_fusion",
             "opv2v/point_pillar_intermediate_fusion", "opv2v/point_pillar_fcooper"]


@dataclass
class Check:
    name: str
    status: str  # ok, failed, skipped
    seconds: float
    detail: str = ""
    figures: dict = field(default_factory=dict)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="gpu_check", help="folder of the report (created)")
    parser.add_argument("--half", action="store_true", help="train and evaluate the baselines with --half too")
    parser.add_argument("--configs", nargs="+", default=BASELINES, help="hypes under hypes_yaml/, without .yaml")
    parser.add_argument("--scale", choices=("small", "demo"), default="small",
                        help="toy world of the synthetic frames (small: 4 test frames)")
    parser.add_argument("--data", help="toy world folder (default: one under --out, generated)")
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


class SkipCheck(Exception):
    pass


# ------------------------------------------------------------------------------------------ in-process checks
def _one_rank_group(device: torch.device):
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    return dist


def check_process_group(device: torch.device) -> tuple[str, dict]:
    dist = _one_rank_group(device)
    try:
        value = torch.arange(4, dtype=torch.float32, device=device)
        dist.all_reduce(value)
        assert value.tolist() == [0.0, 1.0, 2.0, 3.0], value
        return f"{dist.get_backend()} at world size 1, all_reduce on {device}", {"backend": dist.get_backend()}
    finally:
        dist.destroy_process_group()


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 4, 1))


def check_sync_batchnorm(device: torch.device) -> tuple[str, dict]:
    from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm

    dist = _one_rank_group(device)
    try:
        plain = _bn_net().to(device)
        synced, kind = convert_sync_batchnorm(_bn_net(), world_size=2, device=str(device))  # the multi-rank path
        synced = synced.to(device)
        x = torch.randn(4, 3, 16, 16, device=device, generator=None)
        outputs = []
        for net in (plain, synced):
            out = net(x)
            out.square().mean().backward()
            outputs.append((out.detach(), net[0].weight.grad.detach()))
        gap = max((a - b).abs().max().item() for a, b in zip(outputs[0], outputs[1]))
        assert gap < 1e-4, f"{kind} differs from BatchNorm at world size 1 by {gap}"
        return f"{kind}: forward and backward equal BatchNorm at world size 1 (max gap {gap:.1e})", {"kind": kind}
    finally:
        dist.destroy_process_group()


def check_half(device: torch.device, folder: Path) -> tuple[str, dict]:
    """The engine's --half policy (engine/step.py) through a few steps of a small BatchNorm network."""
    from opencood_ddp.engine.step import Precision, forward_backward, optimizer_step
    from opencood_ddp.engine.task import LossOutput

    net = _bn_net().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    precision = Precision(True, device)
    scaler = precision.new_scaler()

    def step(model, x):
        return LossOutput(model(x).float().square().mean())

    for _ in range(3):
        forward_backward(step, net, torch.randn(2, 3, 16, 16, device=device), precision, scaler)
        optimizer_step(optimizer, scaler)
    dtype = str(precision.autocast_dtype).replace("torch.", "")
    if scaler is None:
        return f"{dtype} autocast on the {device.type.upper()} (no GradScaler: {dtype} has float32's range)", \
            {"dtype": dtype}
    path = folder / "scaler.pt"
    torch.save(scaler.state_dict(), path)
    resumed = precision.new_scaler()
    resumed.load_state_dict(torch.load(path, weights_only=False))
    assert resumed.get_scale() == scaler.get_scale(), (resumed.get_scale(), scaler.get_scale())
    return f"{dtype} autocast + GradScaler, scale {scaler.get_scale():g} saved and resumed", \
        {"dtype": dtype, "scale": scaler.get_scale()}


def check_voxelizer(device: torch.device) -> tuple[str, dict]:
    import importlib.metadata as metadata

    from opencood_ddp.data.voxelize import Voxelizer

    wheels = [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].lower().startswith("spconv")]
    points = torch.rand(5000, 4, generator=torch.Generator().manual_seed(0)).numpy()
    points[:, :3] = points[:, :3] * [40, 20, 3] - [20, 10, 2]
    voxels = Voxelizer([0.4, 0.4, 4], [-20, -10, -3, 20, 10, 1], 32, 16000)(points)
    assert voxels["voxel_num_points"].sum() == len(points), "every point inside the range is kept"
    detail = f"{', '.join(wheels) or 'no spconv'}: {len(voxels['voxel_coords'])} pillars from {len(points)} points"
    figures = {"spconv": wheels, "pillars": int(len(voxels["voxel_coords"]))}
    if device.type == "cuda":
        figures["sparse_conv_on_device"] = _sparse_conv_runs(device)
        detail += f"; spconv sparse convolution on {device}: {figures['sparse_conv_on_device']}"
    return detail, figures


def _sparse_conv_runs(device: torch.device) -> str:
    """'yes', or why not: SECOND needs spconv's CUDA kernels (a spconv-cuXXX wheel)."""
    try:
        import spconv.pytorch as spconv

        coords = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2]], dtype=torch.int32, device=device)
        features = torch.ones(2, 4, device=device)
        tensor = spconv.SparseConvTensor(features, coords, [4, 4, 4], 1)
        out = spconv.SubMConv3d(4, 8, 3, indice_key="k").to(device)(tensor)
        return "yes" if out.features.shape == (2, 8) else f"unexpected shape {tuple(out.features.shape)}"
    except Exception as exc:  # noqa: BLE001  reported, not raised: the PointPillar models do not need it
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"


# ------------------------------------------------------------------------------------------ baselines
def _environ(device: torch.device) -> dict:
    from opencood_ddp.distributed.env import SHARE_GPUS_VARIABLE, environ_without_launcher

    environ = environ_without_launcher(os.environ)
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if device.type == "cuda":
        environ[SHARE_GPUS_VARIABLE] = "1"  # 2 ranks on the one GPU, over gloo
    else:
        environ["CUDA_VISIBLE_DEVICES"] = ""
    return environ


def _run(command: list, device: torch.device, timeout: float = 1800) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=REPO,
                            env=_environ(device), timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}: {' '.join(map(str, command[:6]))} ...\n{result.stderr[-1500:]}")
    return result


def _splits(data: Path) -> list[str]:
    return ["--set", f"root_dir={data / 'train'}", "--set", f"validate_dir={data / 'validate'}",
            "--set", f"test_dir={data / 'test'}"]


def _fusion_of(config: str) -> str:
    from opencood_ddp import hypes as hypes_lib
    from opencood_ddp.data.datasets import fusion_methods

    dataset = hypes_lib.load_hypes(REPO / "hypes_yaml" / f"{config}.yaml")["fusion"]["core_method"]
    return next(method for method, name in fusion_methods().items() if name == dataset)


def check_baseline(config: str, device: torch.device, data: Path, work: Path, half: bool) -> tuple[str, dict]:
    from opencood_ddp.distributed.launch import launcher_prefix

    run_dir = work / config.replace("/", "_")
    hypes = REPO / "hypes_yaml" / f"{config}.yaml"
    flags = ["--half"] if half else []
    started = time.perf_counter()
    # One epoch of the toy world: a few steps (small: 4 of 2 frames), and a net_epoch1.pth to evaluate.
    _run([sys.executable, REPO / "tools" / "train_ddp.py", "--hypes_yaml", hypes, "--model_dir", run_dir,
          "--set", "train_params.epoches=1", "--num_workers", "0", *flags, *_splits(data)], device)
    trained = time.perf_counter() - started
    steps = len((run_dir / "train_steps.csv").read_text().splitlines()) - 1
    fusion = _fusion_of(config)
    results = {}
    for world in (1, 2):
        launcher = launcher_prefix(world, torchrun=world > 1)
        backend = [] if world == 1 else ["--dist_backend", "gloo"]
        _run([*launcher, REPO / "tools" / "inference_ddp.py", "--model_dir", run_dir, "--fusion_method", fusion,
              "--epoch", "1", "--dataset_dir", data / "test", "--num_workers", "0", *backend], device)
        found = json.loads(json.dumps(_read_yaml(run_dir / "eval.yaml")))
        results[world] = {k: v for k, v in found.items() if k not in ("world_size", "seconds")}
    assert results[1] == results[2], f"eval.yaml on 2 ranks differs from 1 process: {results[1]} vs {results[2]}"
    return (f"{steps} steps in {trained:.1f} s; eval on 1 and 2 ranks equal (AP@0.5 {results[1]['ap_50']:.3f}, "
            f"{results[1].get('frames')} frames)", {"train_seconds": round(trained, 2), "eval": results[1]})


def _read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def check_memory(config: str, device: torch.device, data: Path, half: bool) -> tuple[str, dict]:
    from opencood_ddp import hypes as hypes_lib
    from opencood_ddp.engine import batch_fit
    from opencood_ddp.tasks import build_task
    from opencood_ddp.yaml_parsers import run_yaml_parser

    path = REPO / "hypes_yaml" / f"{config}.yaml"
    hypes = run_yaml_parser(hypes_lib.apply_overrides(hypes_lib.load_hypes(path), _splits(data)[1::2]), str(path))
    probes = batch_fit.measure(hypes, build_task, [1, 2], device, half)
    rows = {p.per_rank: {"step_s": round(p.step_seconds, 3), "samples_per_s": round(p.per_rank / p.step_seconds, 2),
                         "peak_mib": round(p.peak_bytes / 2 ** 20, 1)} for p in probes}
    text = "; ".join(f"batch {b}: {r['step_s']} s/step, {r['samples_per_s']} samples/s, {r['peak_mib']} MiB"
                     for b, r in rows.items())
    return text, {"per_gpu_batch": rows}


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


def write_report(out: Path, machine: dict, checks: list[Check]) -> None:
    (out / "gpu_check.json").write_text(json.dumps({"environment": machine, "checks": [asdict(c) for c in checks]},
                                                   indent=2))
    lines = ["# gpu_check", "", " ".join(f"{k}: {v};" for k, v in machine.items()), "",
             "| check | status | seconds | detail |", "|---|---|---:|---|"]
    lines += [f"| {c.name} | {c.status} | {c.seconds} | {c.detail.splitlines()[0] if c.detail else ''} |"
              for c in checks]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def ensure_data(args: argparse.Namespace, out: Path) -> Path:
    from opencood_ddp.toy.writer import generate_toy_opv2v

    data = Path(args.data) if args.data else out / f"toy_{args.scale}"
    generate_toy_opv2v(data, seed=0, scale=args.scale)
    return data


def run_checks(args: argparse.Namespace) -> list[Check]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}); pass --device cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = ensure_data(args, out)
    checks = [timed("process_group", lambda: check_process_group(device)),
              timed("sync_batchnorm", lambda: check_sync_batchnorm(device)),
              timed("half", lambda: check_half(device, out)),
              timed("voxelizer", lambda: check_voxelizer(device))]
    with tempfile.TemporaryDirectory(dir=out) as work:
        for config in args.configs:
            checks.append(timed(f"train+eval {config}", lambda c=config: check_baseline(
                c, device, data, Path(work), args.half)))
    for config in args.configs:
        checks.append(timed(f"memory {config}", lambda c=config: check_memory(c, device, data, args.half)))
    write_report(out, environment(device), checks)
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
