"""Session-wide fixtures: expensive runs are made once and shared by the tests that read them."""
import os
from pathlib import Path

import pytest
import torch

from launch import REPO, explain, train

# Under pytest-xdist (`make test`: two pytest processes) each process gets its share of the cores for torch's
# intra-op threads: two processes of 2 threads each on 2 cores ran the in-process tests 1.5x slower than one.
# The workers a test starts set their own (tests/launch.py: one thread each).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(items: list) -> None:
    """The tests marked slow first, each group in its usual order. `make test` runs two pytest processes
    (pytest-xdist), and a long test near the end of the list can leave one of them waiting for the other; with the
    long ones first, the last tests either process runs are short. The tests marked cuda are skipped without a
    CUDA device (`make gpu-tests` runs them on a GPU machine)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make gpu-tests on a GPU machine)"))

SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"


@pytest.fixture(scope="session")
def synthetic_runs(tmp_path_factory):
    """synthetic_runs(world, *flags) -> run folder of tools/train_ddp.py on the synthetic BN task.

    world 0 is a plain `python` run (no launcher); other values use torchrun. Each distinct call trains once.
    """
    cache: dict = {}
    root = tmp_path_factory.mktemp("synthetic_runs")

    def get(world: int, *flags: str) -> Path:
        key = (world, flags)
        if key not in cache:
            run_dir = root / f"run{len(cache)}_w{world}"
            result = train(world, "--hypes_yaml", SYNTHETIC, "--model_dir", run_dir, "--num_workers", "0", *flags)
            assert result.returncode == 0, explain(result)
            cache[key] = run_dir
        return cache[key]

    return get


@pytest.fixture(scope="session")
def toy_small(tmp_path_factory) -> Path:
    """Root of the small toy OPV2V world (train/validate/test splits, seed 0), generated once per session."""
    from opencood_ddp.toy.writer import generate_toy_opv2v

    root = tmp_path_factory.mktemp("toy_small")
    generate_toy_opv2v(root, seed=0, scale="small")
    return root


@pytest.fixture(scope="session")
def toy_small_rsu(tmp_path_factory) -> Path:
    """The small toy OPV2V world with a road-side unit per scenario (V2XSet style, seed 0), generated once."""
    from opencood_ddp.toy.writer import generate_toy_opv2v

    root = tmp_path_factory.mktemp("toy_small_rsu")
    generate_toy_opv2v(root, seed=0, scale="small", rsu=True)
    return root


@pytest.fixture(scope="session")
def toy_dairv2x(toy_small_rsu, tmp_path_factory) -> Path:
    """DAIR-V2X-C-layout copy of the small RSU world (its data_dir: train.json, val.json, test.json inside)."""
    from opencood_ddp.toy.dairv2x_layout import write_dairv2x_copy

    root = tmp_path_factory.mktemp("toy_dairv2x")
    write_dairv2x_copy(toy_small_rsu, root, seed=0)
    return root


@pytest.fixture(scope="session")
def toy_v2v4real(toy_small, tmp_path_factory) -> Path:
    """V2V4Real-layout copy of the small toy world (train/validate/test folders, cars 0 and 1)."""
    from opencood_ddp.toy.v2v4real_layout import write_v2v4real_copy

    root = tmp_path_factory.mktemp("toy_v2v4real")
    write_v2v4real_copy(toy_small, root, seed=0)
    return root
