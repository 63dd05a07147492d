#!/usr/bin/env python
"""Dataset throughput: samples/s through the trainer's loader, and where a loader worker spends its time.

Usage: python tools/benchmarks/benchmark_dataset.py [--data data/toy_opv2v] [--hypes hypes_yaml/toy/...yaml]
                                         [--workers 0 2] [--batch-size 2] [--train] [--torch-threads N]
                                         [--stages [--clouds ascii binary] [--on-device off on]]
                                         [--layouts opv2v opv2v_2cav dairv2x v2v4real [--yaml]
                                          [--upstream OPENCOOD_CHECKOUT]]

The data folder's complete toy world is read whatever its scale; a folder without one gets the demo world
(seed 0). The dataset is the trainer's own (``tasks.build_task``: the post-processor, its targets and labels, the
augmentation as configured): the training set with ``--train``, else the validation set. Each worker count reads
the split through the trainer's loader (``engine/loaders.training_loader``) after a short warm-up in the main process
(the page cache fills); the best of ``--repeats`` passes is reported. Then cProfile runs ``--profile-samples``
samples and their collation in the main process and the cumulative time is grouped into stages.

``--stages`` prints instead the table of issue 51, "what a worker does per sample", for each cloud format and each
value of ``preprocess.on_device``: each stage's ms per sample (cProfile's cumulative times, scaled to the sample's
time measured without the profiler), the total in the main process, a worker's CPU per sample through the trainer's
loader with one worker (its /proc CPU time: the hand-over on the worker's side included), the bytes handed over per
sample, and, with the switch on, what the device's part costs when this CPU runs it. ``--clouds binary`` reads a
binary mirror of the world (``<data>_binary``, made by ``pcd_convert`` when it is missing).

``--layouts`` measures the data sets' readers side by side in one run, each on its copy of the same toy world
(``DATA_dairv2x`` and ``DATA_v2v4real`` beside ``--data``, made by make_toy_opv2v.py's writers; DAIR-V2X-C's from
the world with a road-side unit, ``DATA_rsu``): samples/s and CAVs/s, since their samples hold 2 (DAIR-V2X-C: the
vehicle and the road-side unit; V2V4Real: two cars) or 2-4 (OPV2V) CAVs. Intermediate fusion counts CAVs by
``record_len``. ``opv2v_2cav`` is the OPV2V reader cut to 2 CAVs per sample (``train_params.max_cav=2``): the
control for a reader whose samples hold 2. The readers take turns pass by pass, so a change in the machine's
load falls on all of them. ``--upstream DIR`` adds upstream OpenCOOD's reader (a checkout, with its
dependencies) on OPV2V's copy to the turns. ``--yaml`` adds each frame-yaml reader's parse time per file, PyYAML against ours.
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader

from opencood_ddp.data.augment import WorldTransform
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.device_points import DeviceWork, prepare_batch
from opencood_ddp.data.opv2v import Opv2vYamlLoader, load_yaml_bytes
from opencood_ddp.data.sources.v2v4real import V2V4RealYamlLoader
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.loaders import one_blas_thread, training_loader
from opencood_ddp.tasks import build_task
from opencood_ddp.toy.config import split_overrides
from opencood_ddp.toy.dairv2x_layout import write_dairv2x_copy
from opencood_ddp.toy.v2v4real_layout import write_v2v4real_copy
from opencood_ddp.toy.writer import generate_toy_opv2v, toy_world_in
from opencood_ddp.yaml_parsers import load_parsed_hypes

REPO = Path(__file__).resolve().parents[2]
HANDOVERS = {"in_band": ("in_band",), "shared": ("shared",), "both": ("in_band", "shared")}
DEFAULT_HYPES = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"

# Stage -> (file suffix, function name[, first line]) of the functions whose cumulative time makes up the stage.
# cProfile keys functions by name and line, so a line number singles out one of several methods of one name.
_TRANSFORM_LINES = (inspect.getsourcelines(WorldTransform.points)[1], inspect.getsourcelines(WorldTransform.boxes)[1])
STAGES: Dict[str, Tuple[tuple, ...]] = {
    "pcd read and parse": (("data/pcd.py", "read_pcd"), ("data/pcd.py", "read_pcd_records")),
    "anchor targets": (("postprocess/voxel_postprocessor.py", "generate_label"),
                       ("postprocess/voxel_postprocessor.py", "generate_sparse_label")),
    "pillarisation (spconv)": (("data/voxelize.py", "__call__"),),
    "pose transform of the points": (("data/geometry.py", "transform_points"),),
    "shuffle": (("data/augment.py", "shuffle_points"),),
    "range crop": (("data/geometry.py", "mask_points_by_range"),),
    "ego-hit mask and non-finite check": (("data/geometry.py", "mask_ego_points"),
                                          ("data/datasets/base.py", "report_non_finite")),
    "augmentation": (("data/augment.py", "sample"), ("data/augment.py", "points", _TRANSFORM_LINES[0]),
                     ("data/augment.py", "boxes", _TRANSFORM_LINES[1])),
    "yaml, poses, GT projection": (("data/datasets/base.py", "received_cavs"),
                                   ("data/datasets/base.py", "sample_objects")),
    "collate: labels": (("postprocess/voxel_postprocessor.py", "collate_batch"),),
    "collate: clouds packed": (("data/device_points.py", "collate_raw"),),
    "collate: the rest": (("data/datasets/intermediate_fusion.py", "collate_batch_train"),
                          ("data/datasets/base.py", "collate_batch_train")),
}
# A stage whose functions run inside another's: its time is taken out of the enclosing one.
NESTED = {"collate: labels": "collate: the rest", "collate: clouds packed": "collate: the rest"}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (generated when absent)")
    parser.add_argument("--hypes", default=str(DEFAULT_HYPES), help="hypes YAML naming the dataset")
    parser.add_argument("--split", default="train", choices=("train", "validate", "test"))
    parser.add_argument("--train", action="store_true", help="training mode (augmentation, max_voxel_train)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="passes per worker count; the best is reported")
    parser.add_argument("--profile-samples", type=int, default=24)
    parser.add_argument("--layouts", nargs="+", choices=("opv2v", "opv2v_2cav", "dairv2x", "v2v4real"), default=["opv2v"],
                        help="the data sets' readers to measure side by side, each on its copy of the toy world")
    parser.add_argument("--upstream", metavar="DIR",
                        help="with --layouts: also time upstream OpenCOOD's IntermediateFusionDataset, imported "
                             "from the checkout DIR (its dependencies installed), on OPV2V's copy, in the turns")
    parser.add_argument("--yaml", action="store_true",
                        help="with --layouts: also time each OPV2V-layout reader's frame-yaml parse, PyYAML's "
                             "yaml.load against the readers' route (fast_yaml), per file, in turns")
    parser.add_argument("--handover", choices=sorted(HANDOVERS), default="in_band",
                        help="how workers hand batches over: in_band (the engine's: small tensors inside the "
                             "pickled batch), shared (PyTorch's shared memory for every tensor), or both in turns")
    parser.add_argument("--epoch-start", type=int, default=0, metavar="EPOCHS",
                        help="also time the first batch of each of EPOCHS epochs: a new loader per epoch (the "
                             "trainer's) against one with persistent workers")
    parser.add_argument("--stages", action="store_true",
                        help="the per-sample table of a worker's stages, hand-over and CPU (module docstring)")
    parser.add_argument("--clouds", nargs="+", choices=("ascii", "binary"), default=["ascii", "binary"],
                        help="with --stages: the cloud formats to measure (binary: the world's binary mirror)")
    parser.add_argument("--on-device", nargs="+", choices=("off", "on"), default=["off", "on"],
                        help="with --stages: the values of preprocess.on_device to measure")
    parser.add_argument("--loader-batches", type=int, default=40,
                        help="with --stages: batches a 1-worker loader delivers for the worker's CPU per sample")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a hypes override, as train_ddp.py's --set (repeatable)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch intra-op threads of the main process (0: torch's default). DataLoader workers "
                             "always use 1; spconv's output copies are slow with 2+ threads on a busy machine")
    return parser.parse_args(argv)


def throughput(dataset, batch_size: int, workers: int, handover: str = "in_band") -> Tuple[float, float]:
    """(samples/s, CAVs/s) of one pass over the split; CAVs by record_len where the batch has it. ``handover``:
    the engine's (small tensors in the pickled batch, engine/handover.py) or PyTorch's shared memory for all."""
    collate = dataset.collate_batch_train
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        worker_init_fn=one_blas_thread,
                        collate_fn=InBandSmallTensors(collate) if handover == "in_band" else collate)
    return _pass_rate(loader)


def _pass_rate(batches) -> Tuple[float, float]:
    samples = cavs = 0
    start = time.perf_counter()
    for batch in batches:
        count = int(batch["ego"]["object_bbx_center"].shape[0])
        samples += count
        cavs += int(batch["ego"]["record_len"].sum()) if "record_len" in batch["ego"] else count
    seconds = time.perf_counter() - start
    return samples / seconds, cavs / seconds


def loader_throughput(dataset, collate, batch_size: int, workers: int) -> float:
    """samples/s of one pass over the split through the trainer's own loader (persistent workers, one BLAS thread,
    the engine's hand-over), its workers started before the clock."""
    loader = training_loader(dataset, collate, workers, pin_memory=False)
    indices = list(range(len(dataset)))
    loader.batch_sampler.use(0, [indices[i:i + batch_size] for i in range(0, len(indices), batch_size)])
    return _pass_rate(loader)[0]


def epoch_start(dataset, batch_size: int, workers: int, epochs: int, persistent: bool) -> Tuple[list, float]:
    """(seconds to each epoch's first batch, median seconds of a later batch): a new DataLoader per epoch, as the
    trainer makes one (its workers forked anew), or one loader whose workers persist."""
    batches = [list(range(i, i + batch_size)) for i in range(0, len(dataset) - batch_size + 1, batch_size)]
    loader, firsts, later = None, [], []
    for _ in range(epochs):
        if loader is None or not persistent:
            loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers, persistent_workers=persistent,
                                worker_init_fn=one_blas_thread,
                                collate_fn=InBandSmallTensors(dataset.collate_batch_train))
        start = time.perf_counter()
        batch_iter = iter(loader)
        next(batch_iter)
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        rest = sum(1 for _ in batch_iter)
        later.append((time.perf_counter() - start) / max(rest, 1))
    return firsts, statistics.median(later)


def voxel_points_per_cav(dataset) -> float:
    """The points that land in voxels, per CAV, over the split: the work a CAV costs after its cloud is read
    (a CAV far from the ego has fewer points in the ego's range). NaN where the samples have no voxels."""
    points = cavs = 0
    for index in range(len(dataset)):
        ego = dataset[index]["ego"]
        counts = ego.get("processed_lidar", {}).get("voxel_num_points")
        if counts is None:
            return float("nan")
        counts = counts if isinstance(counts, list) else [counts]
        points += sum(int(count.sum()) for count in counts)
        cavs += int(ego.get("cav_num", 1))
    return points / cavs


def layout_overrides(layout: str, data: Path) -> List[str]:
    """The hypes overrides that read the layout's copy of the toy world in ``data`` (writing the copy first)."""
    if layout in ("opv2v", "opv2v_2cav"):
        cut = ["train_params.max_cav=2"] if layout == "opv2v_2cav" else []
        return cut + split_overrides(data)
    copy = data.with_name(f"{data.name}_{layout}")
    if layout == "v2v4real":
        write_v2v4real_copy(data, copy, seed=0)
        return [f"fusion.dataset={layout}", *split_overrides(copy)]
    world = data.with_name(f"{data.name}_rsu")
    generate_toy_opv2v(world, seed=0, scale="demo", rsu=True)
    write_dairv2x_copy(world, copy, seed=0)
    return [f"fusion.dataset={layout}", f"data_dir={copy}", f"root_dir={copy / 'train.json'}",
            f"validate_dir={copy / 'val.json'}", f"test_dir={copy / 'test.json'}"]


def measure_layouts(args: argparse.Namespace, data: Path) -> None:
    """Every --layouts reader on its copy of the world, one line per reader and worker count. The readers take
    turns pass by pass (best of ``--repeats`` each), so a change in the machine's load falls on all of them."""
    datasets = {}
    for layout in args.layouts:
        hypes = load_parsed_hypes(args.hypes, layout_overrides(layout, data))
        datasets[layout] = build_dataset(hypes, args.split, args.train, seed=0)
        datasets[layout].collate_batch_train([datasets[layout][0], datasets[layout][1]])  # warm-up: spconv's generator, cache
    if args.upstream:
        datasets["upstream"] = upstream_dataset(args, data)
    for workers in args.workers:
        # The hand-over is a worker's: with 0 workers every batch stays in the process.
        handovers = HANDOVERS[args.handover] if workers else ("in_band",)
        # Upstream's loader keeps PyTorch's hand-over; ours is compared with it as the engine runs it.
        turns = [(layout, handover) for layout in datasets
                 for handover in (("shared",) if layout == "upstream" else handovers)]
        best = {turn: (0.0, 0.0) for turn in turns}
        for _ in range(args.repeats):
            for layout, handover in turns:
                measured = throughput(datasets[layout], args.batch_size, workers, handover)
                best[layout, handover] = max(best[layout, handover], measured, key=lambda p: p[1])
        for (layout, handover), (samples, cavs) in best.items():
            reference = best.get(("opv2v", "in_band" if layout == "upstream" else handover), (0.0, 0.0))[1]
            against = f", {cavs / reference:.2f}x OPV2V's CAVs/s" if reference and layout != "opv2v" else ""
            if layout == "upstream" and reference:
                against = f"; our OPV2V reader: {reference / cavs:.1f}x this"
            label = f"{layout} [{handover}]" if len(handovers) > 1 else layout
            print(f"{label:<9} num_workers={workers}: {samples:.1f} samples/s, {cavs:.1f} CAVs/s "
                  f"({len(datasets[layout])} samples{against})")
    for layout, dataset in datasets.items():
        if layout != "upstream":
            print(f"{layout:<9} {voxel_points_per_cav(dataset):.0f} points in voxels per CAV")


def upstream_dataset(args: argparse.Namespace, data: Path):
    """Upstream OpenCOOD's IntermediateFusionDataset from the checkout ``args.upstream``, on the same hypes and
    the same split as ours (upstream's test mode reads ``validate_dir``, so it points at ``--split``)."""
    sys.path.insert(0, str(Path(args.upstream).resolve()))
    from opencood.data_utils.datasets.intermediate_fusion_dataset import IntermediateFusionDataset

    hypes = load_parsed_hypes(args.hypes, layout_overrides("opv2v", data))
    hypes["validate_dir" if not args.train else "root_dir"] = str(data / args.split)
    dataset = IntermediateFusionDataset(hypes, visualize=False, train=args.train)
    dataset.collate_batch_train([dataset[0], dataset[1]])
    return dataset


def frame_yaml_loader(layout: str) -> Optional[type]:
    """The safe loader of a layout whose frames are yaml files (None for DAIR-V2X-C: json, read once)."""
    return {"opv2v": Opv2vYamlLoader, "opv2v_2cav": Opv2vYamlLoader, "v2v4real": V2V4RealYamlLoader}.get(layout)


def measure_yaml(layouts: Sequence[str], data: Path, split: str, repeats: int = 7) -> None:
    """ms per frame yaml of each layout's split: PyYAML's ``yaml.load`` and the readers' route, in turns, on
    the same bytes (read into memory first), with the collector as a dataset process leaves it (enabled)."""
    routes = {"yaml.load": lambda text, loader: yaml.load(text, Loader=loader), "fast_yaml": load_yaml_bytes}
    measured = set()
    for layout in layouts:
        loader = frame_yaml_loader(layout)
        root = data if layout.startswith("opv2v") else data.with_name(f"{data.name}_{layout}")
        if loader is None or root in measured:  # opv2v_2cav reads opv2v's files
            continue
        measured.add(root)
        texts = [path.read_bytes() for path in sorted((root / split).glob("*/*/*.yaml"))]
        best = {route: float("inf") for route in routes}
        for _ in range(repeats):
            for route, parse in routes.items():
                start = time.perf_counter()
                for text in texts:
                    parse(text, loader)
                best[route] = min(best[route], (time.perf_counter() - start) / len(texts))
        size = sum(map(len, texts)) / len(texts) / 1000
        print(f"{layout:<9} frame yaml ({len(texts)} files, {size:.1f} kB each): yaml.load "
              f"{1000 * best['yaml.load']:.3f} ms, fast_yaml {1000 * best['fast_yaml']:.3f} ms per file "
              f"({best['yaml.load'] / best['fast_yaml']:.2f}x)")


def _matches(spec: tuple, filename: str, line: int, function: str) -> bool:
    suffix, name = spec[0], spec[1]
    return filename.endswith(suffix) and function == name and (len(spec) < 3 or spec[2] == line)


def _batches_of(indices: Sequence[int], batch_size: int) -> List[List[int]]:
    return [list(indices[i:i + batch_size]) for i in range(0, len(indices), batch_size)]


def profile(dataset, samples: int, batch_size: int, collate=None) -> Tuple[float, Dict[str, float], List[str]]:
    """(total seconds, seconds per stage, the top functions by own time) for `samples` samples in-process."""
    collate = collate or dataset.collate_batch_train
    profiler = cProfile.Profile()
    indices = list(range(min(samples, len(dataset))))
    start = time.perf_counter()
    profiler.enable()
    for batch in _batches_of(indices, batch_size):
        collate([dataset[i] for i in batch])
    profiler.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    stages = {stage: 0.0 for stage in STAGES}
    for (filename, line, function), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for stage, functions in STAGES.items():
            if any(_matches(spec, filename, line, function) for spec in functions):
                stages[stage] += cumulative
    for inner, outer in NESTED.items():
        stages[outer] -= stages[inner]
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:8]  # type: ignore[attr-defined]
    top = [f"{own:7.3f} s own  {Path(filename).name}:{function}" for (filename, _, function), (_, _, own, _, _)
           in rows]
    return total, stages, top


# ------------------------------------------------------------------------------- --stages: a worker's sample
def trainer_dataset(hypes: dict, train: bool):
    """The trainer's dataset and collate (tasks.build_task): its training set, or its validation set."""
    task = build_task(hypes, for_training=train)
    return (task.train_set, task.collate_train) if train else (task.val_set, task.collate_val)


def handed_bytes(value) -> int:
    """Bytes of the arrays and tensors a collated batch holds (what a worker hands over), DeviceWork included."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, DeviceWork):
        return handed_bytes(vars(value))
    if isinstance(value, dict):
        return sum(handed_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(handed_bytes(item) for item in value)
    return 0


def in_process_seconds(dataset, collate, indices: Sequence[int], batch_size: int, repeats: int) -> float:
    """Seconds per sample of reading and collating ``indices`` in this process, the best of ``repeats`` passes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for batch in _batches_of(indices, batch_size):
            collate([dataset[i] for i in batch])
        best = min(best, (time.process_time() - start) / len(indices))
    return best


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_cpu_seconds(dataset, collate, batch_size: int, batches: int) -> float:
    """A worker's CPU seconds per sample through the trainer's loader with one worker: reading, collating and
    handing ``batches`` batches over (pickling, shared memory), after one batch of warm-up."""
    loader = training_loader(dataset, collate, 1, pin_memory=False)
    keys = [[(first * batch_size + k) % len(dataset) for k in range(batch_size)] for first in range(batches + 1)]
    loader.batch_sampler.use(0, keys)
    delivered = iter(loader)
    next(delivered)
    pid = delivered._workers[0].pid  # type: ignore[attr-defined]
    start = process_cpu_seconds(pid)
    for _ in delivered:
        pass
    return (process_cpu_seconds(pid) - start) / (batches * batch_size)


def device_part_seconds(dataset, collate, indices: Sequence[int], batch_size: int) -> float:
    """Seconds per sample of the device's part (prepare_batch) when this process's CPU runs it."""
    batches = [collate([dataset[i] for i in batch]) for batch in _batches_of(indices, batch_size)]
    start = time.process_time()
    for batch in batches:
        prepare_batch(batch, torch.device("cpu"))
    return (time.process_time() - start) / len(indices)


def stage_column(args: argparse.Namespace, root: Path, on_device: bool) -> Dict[str, float]:
    """One column of the --stages table: ms per sample of each stage and the totals, bytes handed over."""
    overrides = layout_overrides("opv2v", root) + [f"preprocess.on_device={str(on_device).lower()}"]
    hypes = load_parsed_hypes(args.hypes, overrides + list(args.overrides))
    dataset, collate = trainer_dataset(hypes, args.train)
    indices = list(range(min(args.profile_samples, len(dataset))))
    collate([dataset[i] for i in indices[:args.batch_size]])  # warm-up: the page cache, the anchors' grid
    total = in_process_seconds(dataset, collate, indices, args.batch_size, args.repeats)
    profiled, stages, _ = profile(dataset, len(indices), args.batch_size, collate)
    scale = total * len(indices) / profiled  # the profiler's overhead taken out, evenly
    column = {stage: 1000 * seconds * scale / len(indices) for stage, seconds in stages.items()}
    column["other"] = 1000 * total - sum(column.values())
    column["total in the main process"] = 1000 * total
    column["a worker's CPU, hand-over included"] = 1000 * worker_cpu_seconds(dataset, collate, args.batch_size,
                                                                               args.loader_batches)
    # What a worker pays beyond the same work in this process: the hand-over (pickling, shared memory's fresh
    # pages) and the fresh pages of its own large temporaries (ascii bodies), which this warmed process reuses.
    column["a worker's extra: hand-over, fresh pages"] = column["a worker's CPU, hand-over included"] - 1000 * total
    batch = collate([dataset[i] for i in indices[:args.batch_size]])
    column["MB handed over"] = handed_bytes(batch) / args.batch_size / 1e6
    if on_device:
        column["the device's part, on this CPU"] = 1000 * device_part_seconds(dataset, collate, indices,
                                                                               args.batch_size)
    return column


def measure_stages(args: argparse.Namespace, data: Path) -> None:
    """The --stages table: one column per cloud format and value of preprocess.on_device."""
    from opencood_ddp.data.pcd_convert import binary_mirror

    roots = {"ascii": data, "binary": binary_mirror(data) if "binary" in args.clouds else None}
    columns = {f"{clouds}, on_device {mode}": stage_column(args, roots[clouds], mode == "on")
               for clouds in args.clouds for mode in args.on_device}
    rows: List[str] = []
    for column in columns.values():
        rows += [row for row in column if row not in rows]
    print(f"\nms per sample ({args.profile_samples} samples, batches of {args.batch_size}, best of {args.repeats} "
          f"passes; a worker's CPU over {args.loader_batches} batches)")
    print("| stage | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for row in rows:
        cells = [f"{column[row]:.2f}" if row == "MB handed over" else f"{column[row]:.1f}" if row in column else ""
                 for column in columns.values()]
        print(f"| {row} | " + " | ".join(cells) + " |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    summary = toy_world_in(args.data, scale="demo")
    data = Path(args.data)
    if args.layouts != ["opv2v"]:
        measure_layouts(args, data)
        if args.yaml:
            measure_yaml(args.layouts, data, args.split)
        return 0
    clouds = summary.get("points_per_cloud", {}).get("mean")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    if args.stages:
        print(f"{args.hypes} on {data}, train={args.train}, ~{clouds} points per cloud")
        measure_stages(args, data)
        return 0
    hypes = load_parsed_hypes(args.hypes, layout_overrides("opv2v", data) + list(args.overrides))
    dataset, collate = trainer_dataset(hypes, args.train)
    print(f"{hypes['fusion']['core_method']} (the trainer's {'training' if args.train else 'validation'} set) on "
          f"{data}: {len(dataset)} samples, batch {args.batch_size}, ~{clouds} points per cloud")
    collate([dataset[0], dataset[1]])  # warm-up: page cache
    for workers in args.workers:
        best = max(loader_throughput(dataset, collate, args.batch_size, workers) for _ in range(args.repeats))
        print(f"num_workers={workers}: {best:.1f} samples/s")
    for workers in [w for w in args.workers if w and args.epoch_start]:
        for persistent in (False, True):
            firsts, later = epoch_start(dataset, args.batch_size, workers, args.epoch_start, persistent)
            print(f"num_workers={workers} {'persistent workers' if persistent else 'new workers each epoch'}: "
                  f"first batch of each epoch {', '.join(f'{x:.3f}' for x in firsts)} s; a later batch {later:.3f} s")

    total, stages, top = profile(dataset, args.profile_samples, args.batch_size, collate)
    print(f"\ncProfile, {args.profile_samples} samples + collate in one process: {total:.2f} s "
          f"({1000 * total / args.profile_samples:.1f} ms/sample; profiling overhead included)")
    for stage, seconds in sorted(stages.items(), key=lambda item: -item[1]):
        print(f"  {stage:<28} {seconds:7.3f} s  {100 * seconds / total:5.1f} %")
    print("top functions by own time:")
    for line in top:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
