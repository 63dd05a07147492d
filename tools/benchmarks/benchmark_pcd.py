"""Time opencood_ddp.data.pcd.read_pcd against open3d's read_point_cloud on 100k-point clouds.

Usage: python tools/benchmarks/benchmark_pcd.py [--points 100000] [--repeats 15] [--out DIR]

Clouds are written by open3d itself (ascii and binary, colours = [i, i, i] as OPV2V stores intensity), plus the
old-open3d ascii layout our writer produces (TYPE F colour). The two readers run alternately, ``--repeats`` times
per file, and the best time is reported; their results are checked to be bit-identical first.
Then the first ascii read of a fresh process is timed with an empty numba cache (JIT compile) and with the cache
that run left (what every later process, e.g. each DataLoader worker, pays).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numba
import numpy as np
import open3d

from opencood_ddp.data.pcd import read_pcd, write_pcd

_FIRST_READ = """
import sys, time
start = time.perf_counter()
from opencood_ddp.data import pcd
imported = time.perf_counter()
pcd.read_pcd(sys.argv[1])
done = time.perf_counter()
print(f"{imported - start:.3f} {done - imported:.3f}")
"""


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


def first_read_seconds(path: str, cache_dir: str) -> tuple[float, float]:
    """(import of opencood_ddp.data.pcd, first read_pcd) in a fresh process using numba cache ``cache_dir``."""
    environ = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    result = subprocess.run([sys.executable, "-c", _FIRST_READ, path], env=environ, capture_output=True, text=True,
                            check=True)
    imported, first = result.stdout.split()
    return float(imported), float(first)


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
              f"numpy {np.__version__}, numba {numba.__version__}, open3d {open3d.__version__}, "
              f"nproc {os.cpu_count()}, {platform.machine()}, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print()
        print("| file | open3d read_point_cloud (ms) | read_pcd (ms) | speedup |")
        print("|---|---:|---:|---:|")
        for label, path in files.items():
            if not np.array_equal(read_pcd(path).view(np.uint32), read_with_open3d(path).view(np.uint32)):
                sys.exit(f"{label}: read_pcd and open3d disagree")
            best = best_of(readers, path, args.repeats)
            print(f"| {label} | {best['open3d'] * 1e3:.2f} | {best['read_pcd'] * 1e3:.2f} | "
                  f"{best['open3d'] / best['read_pcd']:.1f}x |")
        print(f"load average after the timings: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

        ascii_path = files["ascii (OPV2V layout, rgb F)"]
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = first_read_seconds(ascii_path, cache_dir)
            warm = first_read_seconds(ascii_path, cache_dir)
        print()
        print("First ascii read_pcd in a fresh process (after importing opencood_ddp.data.pcd):")
        print(f"- empty numba cache (JIT compile, then written to the cache): {cold[1]:.2f} s "
              f"(import {cold[0]:.2f} s)")
        print(f"- numba cache present (loaded from disk): {warm[1]:.2f} s (import {warm[0]:.2f} s)")


if __name__ == "__main__":
    main()
