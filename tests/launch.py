"""Start real worker processes the way users do: torchrun (c10d rendezvous on loopback, gloo backend)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional, Sequence

import torch

from opencood_ddp.distributed.env import environ_without_launcher
from opencood_ddp.distributed.launch import launcher_prefix
from opencood_ddp.toy.config import split_overrides, split_set_flags  # noqa: F401  (tests take both from here)

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
TRAIN = REPO / "tools" / "train_ddp.py"


def clean_environ(extra: Optional[dict] = None) -> dict:
    """The test's environment without any launcher variables the test runner itself might carry, with one
    OpenMP thread per process (the workers share the machine) and unbuffered output, plus `extra`."""
    environ = environ_without_launcher(os.environ)
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    environ.update(extra or {})
    return environ


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 300,
             extra_env: Optional[dict] = None) -> subprocess.CompletedProcess:
    cmd = [*launcher_prefix(nproc), str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_environ(extra_env))


def python(script: Path, *args: str, timeout: float = 300, extra_env: Optional[dict] = None,
           wrapper: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """A plain `python script args` start, in a new process (`wrapper`: a command that starts it, e.g. setpriv)."""
    cmd = [*wrapper, sys.executable, str(script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean_environ(extra_env))


def train(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tools/train_ddp.py on `nproc` torchrun processes, or for 0 as a plain `python` start runs it: its
    `__main__` in this process (`in_process`; pytest-timeout bounds it instead of `timeout`)."""
    if nproc == 0:
        return in_process(TRAIN, *args)
    return torchrun(nproc, TRAIN, *args, timeout=timeout)


def toy_overrides(root: Path, layout: str = "opv2v") -> list[str]:
    """The hypes overrides (key=value, as --set takes them) that read the toy world in `root`, written in `layout`:
    opv2v (its split folders), v2v4real (the V2V4Real-layout copy) or dairv2x (the DAIR-V2X-C-layout copy: its
    data_dir and split files)."""
    if layout == "dairv2x":
        return ["fusion.dataset=dairv2x", f"data_dir={root}", f"root_dir={root / 'train.json'}",
                f"validate_dir={root / 'val.json'}", f"test_dir={root / 'test.json'}"]
    if layout not in ("opv2v", "v2v4real"):
        raise ValueError(f"no toy layout {layout!r}")
    return ([] if layout == "opv2v" else [f"fusion.dataset={layout}"]) + split_overrides(root)


def dairv2x_overrides(data_dir: Path) -> list[str]:
    """--set flags that read the DAIR-V2X-C-layout toy copy in `data_dir` (fusion.dataset and its split files)."""
    return [word for override in toy_overrides(data_dir, "dairv2x") for word in ("--set", override)]


def v2v4real_overrides(root: Path) -> list[str]:
    """--set flags that read the V2V4Real-layout toy copy in `root`."""
    return ["--set", "fusion.dataset=v2v4real", *split_set_flags(root)]


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"


class Background:
    """tools/train_ddp.py started without waiting (torchrun with `nproc` workers, or plain python for 0), its
    output going to files, so that a test can signal it, or one of its workers, while it trains."""

    def __init__(self, folder: Path, nproc: int, *args: str, torchrun_args: tuple = (),
                 extra_env: Optional[dict] = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = folder / "stdout.txt", folder / "stderr.txt"
        cmd = [*launcher_prefix(nproc, launcher_args=torchrun_args), str(TRAIN), *map(str, args)]
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env=clean_environ(extra_env),
                                         start_new_session=True)

    def worker_pids(self) -> dict[int, int]:
        """{global rank: pid} of torchrun's worker processes, read from /proc."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid:
                for item in environ:
                    if item.startswith(b"RANK="):
                        found[int(item[5:])] = int(entry.name)
        return found

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.out_path.read_text(),
                                           self.err_path.read_text())

    def kill(self) -> None:
        """SIGKILL whatever is left of the process group (stopped workers included)."""
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_until(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def one_line_error(exc_info, *fragments: str) -> str:
    """The message of a raised project error (pytest's ExceptionInfo): one line, holding every fragment."""
    message = str(exc_info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for the block, and put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_process(script: Path, *args: str) -> subprocess.CompletedProcess:
    """A tool's `__main__` run in this process, as a plain `python script args` start runs it (the same entry
    path, `run_distributed` at world size 1), without the seconds of a new interpreter. Its exit code, stdout
    and stderr come back as a CompletedProcess. What a run may leave in the process is put back: the launcher
    variables stay out of the environment, the signal handlers and the package logger's handlers are restored.
    It runs on one thread, as every process the tests start (OMP_NUM_THREADS=1), so that its floats compare
    with theirs bit for bit."""
    import io
    import runpy

    from opencood_ddp.engine.entry import entry_sandbox

    saved_argv = sys.argv
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [str(script), *map(str, args)]
    try:
        with torch_threads(1), entry_sandbox(clean_environ()), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as exc:  # the tools end with sys.exit(code); argparse exits 2 on a bad flag
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
    return subprocess.CompletedProcess([str(script), *map(str, args)], code, out.getvalue(), err.getvalue())


def load_tool(relative: str) -> ModuleType:
    """A script under tools/ (not a package), e.g. "analysis/attention_by_visibility.py", loaded as a module by
    its path, in process. It is registered in sys.modules: dataclasses look their module up while the file runs."""
    name = "tool_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
