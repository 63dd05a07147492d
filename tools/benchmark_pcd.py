"""Time opencood_ddp.data.pcd.read_pcd against open3d's read_point_cloud on 100k-point clouds.

Usage: python tools/benchmark_pcd.py [--points 100000] [--repeats 15] [--out DIR]

Clouds are written by open3d itself (ascii and binary, colours = [i, i, i] as OPV2V stores intensity), plus the
old-open3d ascii layout our writer produces (TYPE F colour). Each reader runs alternately, ``--repeats`` times per
file, and the best time is reported; both results are checked to be bit-identical before timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import open3d

from opencood_ddp.data.pcd import read_pcd, write_pcd


def make_cloud(points: int, seed: int = 0) -> np.ndarray:
    """LiDAR-like points: x, y in +-100 m, z in -3..1 m, intensity in 0..1, float32."""
    rng = np.random.default_rng(seed)
    cloud = np.empty((points, 4), dtype=np.float32)
    cloud[:, :2] = rng.uniform(-100.0, 100.0, (points, 2))
    cloud[:, 2] = rng.uniform(-3.0, 1.0, points)
    cloud[:, 3] = rng.random(points)
    return cloud


def write_with_open3d(path: str, cloud: np.ndarray, ascii_data: bool) -> None:
    geometry = open3d.geometry.PointCloud()
    geometry.points = open3d.utility.Vector3dVector(cloud[:, :3].astype(np.float64))
    intensity = cloud[:, 3].astype(np.float64)
    geometry.colors = open3d.utility.Vector3dVector(np.stack([intensity] * 3, axis=1))
    open3d.io.write_point_cloud(path, geometry, write_ascii=ascii_data)


def read_with_open3d(path: str) -> np.ndarray:
    geometry = open3d.io.read_point_cloud(path)
    out = np.empty((len(geometry.points), 4), dtype=np.float32)
    out[:, :3] = np.asarray(geometry.points)
    out[:, 3] = np.asarray(geometry.colors)[:, 0]
    return out


def best_of(readers: dict[str, Callable[[str], np.ndarray]], path: str, repeats: int) -> dict[str, float]:
    """Best wall time in seconds of each reader, run alternately so that machine load hits both alike."""
    best = {name: float("inf") for name in readers}
    for _ in range(repeats):
        for name, reader in readers.items():
            start = time.perf_counter()
            reader(path)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="folder for the generated clouds (default: a temp folder)")
    args = parser.parse_args()

    cloud = make_cloud(args.points)
    readers = {"open3d": read_with_open3d, "read_pcd": read_pcd}
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or scratch
        files = {
            "ascii (open3d 0.20 writer, rgb U)": os.path.join(folder, "cloud_ascii.pcd"),
            "ascii (OPV2V layout, rgb F)": os.path.join(folder, "cloud_ascii_f.pcd"),
            "binary (open3d writer)": os.path.join(folder, "cloud_binary.pcd"),
        }
        write_with_open3d(files["ascii (open3d 0.20 writer, rgb U)"], cloud, ascii_data=True)
        write_pcd(files["ascii (OPV2V layout, rgb F)"], cloud, binary=False)
        write_with_open3d(files["binary (open3d writer)"], cloud, ascii_data=False)

        print(f"{args.points} points, best of {args.repeats}; python {platform.python_version()}, "
              f"numpy {np.__version__}, open3d {open3d.__version__}, nproc {os.cpu_count()}, {platform.machine()}")
        print()
        print("| file | open3d read_point_cloud (ms) | read_pcd (ms) | speedup |")
        print("|---|---:|---:|---:|")
        for label, path in files.items():
            if not np.array_equal(read_pcd(path), read_with_open3d(path), equal_nan=True):
                sys.exit(f"{label}: read_pcd and open3d disagree")
            best = best_of(readers, path, args.repeats)
            print(f"| {label} | {best['open3d'] * 1e3:.2f} | {best['read_pcd'] * 1e3:.2f} | "
                  f"{best['open3d'] / best['read_pcd']:.1f}x |")


if __name__ == "__main__":
    main()
