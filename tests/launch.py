"""Start real worker processes the way users do: torchrun (c10d rendezvous on loopback, gloo backend)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
TRAIN = REPO / "tools" / "train_ddp.py"


def clean_env(extra: Optional[dict] = None) -> dict:
    """The test's environment without any launcher variables the test runner itself might carry."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 300,
             extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_env(extra_env))


def python(script: Path, *args: str, timeout: float = 300,
           extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_env(extra_env))


def train(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tools/train_ddp.py on `nproc` processes (0 = plain `python`, no launcher)."""
    if nproc == 0:
        return python(TRAIN, *args, timeout=timeout)
    return torchrun(nproc, TRAIN, *args, timeout=timeout)


def split_overrides(toy_root: Path) -> list[str]:
    """--set flags that point a toy hypes at the splits of the toy world in `toy_root`."""
    return ["--set", f"root_dir={toy_root / 'train'}", "--set", f"validate_dir={toy_root / 'validate'}",
            "--set", f"test_dir={toy_root / 'test'}"]


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"
