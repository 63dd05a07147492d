"""opencood_ddp: OpenCOOD-compatible cooperative perception with correct multi-GPU training.

torch is deliberately not resolved here with a loose range: the Makefile installs torch==2.13.0
first (CPU build here, a CUDA build on GPU machines), and every requirement below is satisfied
without pulling another torch.
"""
from setuptools import find_packages, setup

CORE = [
    "numpy>=1.24",
    "pyyaml>=6",
    "scipy>=1.10",
    "shapely>=2.0",
    "tqdm>=4.60",
    "tensorboardX>=2.6",
    "matplotlib>=3.7",
    # the ASCII .pcd parser is compiled with it (5x open3d); numba 0.68.1 supports Python 3.10 and later
    "numba==0.68.1",
    # DataLoader workers run numpy's BLAS on one thread (engine/loaders.py)
    "threadpoolctl>=3.1",
]

setup(
    name="opencood_ddp",
    version="0.1.0",
    description="OpenCOOD-style cooperative 3D detection whose DDP runs reproduce the single-GPU baseline",
    packages=find_packages(include=["opencood_ddp", "opencood_ddp.*"]),
    python_requires=">=3.10",
    install_requires=CORE + ["torch>=2.0"],
    extras_require={
        # CPU stack: spconv's CPU wheel (its point-to-voxel generator is what the data pipeline uses).
        "cpu": ["spconv==2.3.8", "open3d-cpu==0.20.0"],
        # CUDA stack: spconv's CUDA wheel depends on the installed torch's CUDA version, which an extra cannot
        # know; `make venv EXTRAS=cuda` adds the one `tools/ci/pins.py spconv` names (spconv-cu118 ... cu126).
        "cuda": ["open3d-cpu==0.20.0"],
        # pytest-timeout: a test that hangs (a rank waiting on a collective that never comes) fails alone after
        # pytest.ini's timeout instead of stalling the whole CI run. pytest-xdist: `make test` runs two test
        # processes (the Makefile says why).
        "test": ["pytest>=7", "pytest-timeout==2.3.1", "pytest-xdist==3.8.0"],
    },
)
