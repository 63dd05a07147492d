#!/usr/bin/env python
"""Dataset throughput: samples/s through a DataLoader, and where one process spends its time.

Usage: python tools/benchmarks/benchmark_dataset.py [--data data/toy_opv2v] [--hypes hypes_yaml/toy/...yaml]
                                         [--workers 0 2] [--batch-size 2] [--train] [--torch-threads N]
                                         [--layouts opv2v opv2v_2cav dairv2x v2v4real [--yaml]
                                          [--upstream OPENCOOD_CHECKOUT]]

The data folder's complete toy world is read whatever its scale; a folder without one gets the demo world
(seed 0). Each worker count reads the whole split once after a short warm-up in the main process (the first
voxelization builds spconv's generator; the page cache fills); the best of ``--repeats`` passes is reported. Then cProfile runs ``--profile-samples`` samples and their
collation in the main process and the cumulative time is grouped into stages.

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

import torch
import yaml
from torch.utils.data import DataLoader

from opencood_ddp.data.augment import WorldTransform
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.opv2v import Opv2vYamlLoader, load_yaml_bytes
from opencood_ddp.data.sources.v2v4real import V2V4RealYamlLoader
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.loaders import one_blas_thread
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
    "pcd read": (("data/pcd.py", "read_pcd"),),
    "yaml parse": (("data/opv2v.py", "load_opv2v_yaml"),),
    "GT projection": (("data/geometry.py", "project_world_objects"),),
    "point projection": (("data/geometry.py", "transform_points"),),
    "shuffle + ego mask + crop": (("data/augment.py", "shuffle_points"), ("data/geometry.py", "mask_ego_points"),
                                  ("data/geometry.py", "mask_points_by_range")),
    "augmentation": (("data/augment.py", "sample"), ("data/augment.py", "points", _TRANSFORM_LINES[0]),
                     ("data/augment.py", "boxes", _TRANSFORM_LINES[1])),
    "voxelization": (("data/voxelize.py", "__call__"),),
    "collate": (("data/datasets/intermediate_fusion.py", "collate_batch_train"),
                ("data/datasets/base.py", "collate_batch_train")),
}


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
    samples = cavs = 0
    start = time.perf_counter()
    for batch in loader:
        count = int(batch["ego"]["object_bbx_center"].shape[0])
        samples += count
        cavs += int(batch["ego"]["record_len"].sum()) if "record_len" in batch["ego"] else count
    seconds = time.perf_counter() - start
    return samples / seconds, cavs / seconds


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


def profile(dataset, samples: int, batch_size: int) -> Tuple[float, Dict[str, float], List[str]]:
    """(total seconds, seconds per stage, the top functions by own time) for `samples` samples in-process."""
    profiler = cProfile.Profile()
    indices = list(range(min(samples, len(dataset))))
    start = time.perf_counter()
    profiler.enable()
    for first in range(0, len(indices), batch_size):
        dataset.collate_batch_train([dataset[i] for i in indices[first:first + batch_size]])
    profiler.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    stages = {stage: 0.0 for stage in STAGES}
    for (filename, line, function), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for stage, functions in STAGES.items():
            if any(_matches(spec, filename, line, function) for spec in functions):
                stages[stage] += cumulative
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:8]  # type: ignore[attr-defined]
    top = [f"{own:7.3f} s own  {Path(filename).name}:{function}" for (filename, _, function), (_, _, own, _, _)
           in rows]
    return total, stages, top


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
    hypes = load_parsed_hypes(args.hypes, layout_overrides("opv2v", data))
    dataset = build_dataset(hypes, args.split, args.train, seed=0)
    clouds = summary.get("points_per_cloud", {}).get("mean")
    print(f"{hypes['fusion']['core_method']} on {data / args.split}: {len(dataset)} samples, "
          f"train={args.train}, batch {args.batch_size}, ~{clouds} points per cloud")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")
    dataset.collate_batch_train([dataset[0], dataset[1]])  # warm-up: spconv's generator, page cache
    for workers in args.workers:
        best = max(throughput(dataset, args.batch_size, workers)[0] for _ in range(args.repeats))
        print(f"num_workers={workers}: {best:.1f} samples/s")
    for workers in [w for w in args.workers if w and args.epoch_start]:
        for persistent in (False, True):
            firsts, later = epoch_start(dataset, args.batch_size, workers, args.epoch_start, persistent)
            print(f"num_workers={workers} {'persistent workers' if persistent else 'new workers each epoch'}: "
                  f"first batch of each epoch {', '.join(f'{x:.3f}' for x in firsts)} s; a later batch {later:.3f} s")

    total, stages, top = profile(dataset, args.profile_samples, args.batch_size)
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
