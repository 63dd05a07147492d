#!/usr/bin/env python
"""The project's pinned requirements: which spconv wheel fits the installed torch, and whether every pin exists.

    python tools/ci/pins.py spconv            # the spconv requirement for this venv's torch (torch.version.cuda)
    python tools/ci/pins.py check             # resolve every pin for Python 3.11 and 3.12 on manylinux x86_64
    python tools/ci/pins.py check --extra 'spconv-cu120==2.3.8'   # ... and one more (a wrong pin fails)

spconv publishes one package per CUDA version (spconv-cu118, spconv-cu120, ...), and not every version of each:
2.3.8 exists for cu118, cu121, cu124 and cu126, while spconv-cu120 stops at 2.3.6. A static `cuda` extra
cannot know the user's CUDA, so the Makefile asks this script after torch is installed. `check` resolves each
pin with pip's resolver in dry-run mode against the package index, for each target Python and the manylinux
x86_64 platforms, without installing or downloading a wheel (only its metadata). It reads only the standard
library and pip, so it runs before the package is installed.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
SPCONV_VERSION = "2.3.8"
PYTHONS = ("3.11", "3.12")
# torch.version.cuda (major, minor) -> spconv's package, version, the Pythons it has wheels for, and the oldest
# glibc its wheels install on (their manylinux tag: 2014 is glibc 2.17; cu124 and cu126 are built on 2.28 only, which
# many clusters' older systems lack). spconv's wheels carry their own CUDA kernels and run under any driver of a CUDA
# version at or above their build, so a torch built for a CUDA version spconv does not publish, or whose build does
# not install on this glibc, takes the newest spconv build at or below it that does.
SPCONV_CUDA = {
    (11, 8): ("spconv-cu118", SPCONV_VERSION, PYTHONS, (2, 17)),
    (12, 0): ("spconv-cu120", "2.3.6", ("3.11",), (2, 17)),  # cu120 stops at 2.3.6, with no Python 3.12 wheel
    (12, 1): ("spconv-cu121", SPCONV_VERSION, PYTHONS, (2, 17)),
    (12, 4): ("spconv-cu124", SPCONV_VERSION, PYTHONS, (2, 28)),
    (12, 6): ("spconv-cu126", SPCONV_VERSION, PYTHONS, (2, 28)),
}
SPCONV_CPU = ("spconv", SPCONV_VERSION, PYTHONS)
# manylinux x86_64, every glibc level a wheel of ours may be tagged with (open3d's start at 2.27 or later).
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)))


def wheel_target_args(python: str) -> list[str]:
    """pip's flags for wheels of CPython `python` on manylinux x86_64, whatever this machine is."""
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def spconv_requirement(cuda: Optional[str], python: str = PYTHONS[0],
                       glibc: Optional[Tuple[int, int]] = None) -> tuple[str, str]:
    """(requirement, note) for torch.version.cuda `cuda` (None or '': a CPU build of torch) on `python`, for a
    machine with `glibc` (major, minor; None: any)."""
    if not cuda:
        return f"spconv=={SPCONV_VERSION}", "CPU torch: spconv's CPU wheel"
    major, minor = (int(part) for part in cuda.split(".")[:2])
    build = _newest_build(major, minor, python, glibc)
    if build is None:
        return (f"spconv=={SPCONV_VERSION}",
                f"no spconv wheel is built for CUDA {cuda}: spconv's CPU wheel instead; the data pipeline and "
                f"the PointPillar models work, SECOND (sparse 3-D convolutions) cannot run on the GPU")
    name, version, _, _ = SPCONV_CUDA[build]
    note = f"CUDA {cuda}, Python {python}: {name} {version} (a CUDA {build[0]}.{build[1]} build)"
    if build[0] < major:
        # CUDA 13 (no build at all), CUDA 12.0 on Python 3.12 (cu120 has no 3.12 wheel; cu121 needs a 12.1 driver)
        note += (f"; spconv publishes no CUDA {major} build at or below {cuda} for Python {python}, and a CUDA "
                 f"{major} driver runs this one")
    preferred = _newest_build(major, minor, python, None)
    if preferred != build:
        wanted, _, _, needs = SPCONV_CUDA[preferred]
        note += (f"; {wanted} would match better but needs glibc {needs[0]}.{needs[1]} or newer, and the glibc "
                 f"here is {glibc[0]}.{glibc[1]}")
    return f"{name}=={version}", note


def _newest_build(major: int, minor: int, python: str, glibc: Optional[Tuple[int, int]]) -> Optional[tuple]:
    """The SPCONV_CUDA key to use for a torch of CUDA major.minor, or None when no CUDA build fits."""
    usable = [key for key, (_, _, pythons, needs) in SPCONV_CUDA.items()
              if python in pythons and key <= (major, minor) and (glibc is None or glibc >= needs)]
    # The newest build at or below torch's CUDA, also of an older major: a driver runs the kernels of every older
    # CUDA. CUDA 12.0 on Python 3.12 takes the 11.8 build; CUDA 13, for which spconv publishes no build, takes
    # cu126, which gpu_check ran on an H200 beside torch 2.11+cu130 (SECOND trained, resumed and evaluated in
    # fp32, fp16 and bf16; docs/benchmarks.md).
    return max(usable) if usable else None


def machine_glibc() -> Optional[Tuple[int, int]]:
    """This machine's glibc (major, minor), or None where it is not glibc (musl, macOS)."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""  # 'glibc 2.36'
    except (AttributeError, ValueError, OSError):
        return None
    return parse_glibc(text.split()[-1]) if text.startswith("glibc") else None


def parse_glibc(text: str) -> Tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def installed_torch_cuda() -> Optional[str]:
    import torch  # only here: `check` must run without torch

    return torch.version.cuda


def setup_pins(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """Every `==` requirement of setup.py: CORE and each extra (read from its literals, not by running it)."""
    tree = ast.parse(setup_py.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "==" in node.value \
                and " " not in node.value and not node.value.startswith(("=", ".")):
            found.append(node.value)
    return sorted(set(found))


def every_pin(torch_version: str) -> list[tuple[str, tuple[str, ...]]]:
    """(requirement, the Pythons it must resolve for): setup.py's pins and torch's for every Python, each spconv
    build of the table for the Pythons it serves."""
    pins = {(req, PYTHONS) for req in setup_pins() + [f"torch=={torch_version}"]}
    pins |= {(f"{name}=={version}", pythons) for name, version, pythons, *_ in [*SPCONV_CUDA.values(), SPCONV_CPU]}
    return sorted(pins)


def resolve(requirement: str, python: str) -> Optional[str]:
    """None when pip finds a wheel of `requirement` for `python` on manylinux x86_64, else pip's reason."""
    with tempfile.TemporaryDirectory() as target:
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", *wheel_target_args(python),
                   "--target", target, "--quiet", "--report", str(Path(target) / "report.json"),
                   "--disable-pip-version-check"]
        result = subprocess.run(command + [requirement], capture_output=True, text=True)
        if result.returncode == 0:
            report = json.loads((Path(target) / "report.json").read_text())
            if report.get("install"):
                return None
            return "pip resolved nothing"
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    return errors[0] if errors else (result.stderr.strip().splitlines() or ["pip failed"])[-1]


def check(pins: Sequence[tuple[str, Sequence[str]]]) -> int:
    failures = 0
    for requirement, pythons in pins:
        for python in pythons:
            problem = resolve(requirement, python)
            print(f"{'ok  ' if problem is None else 'FAIL'} {requirement:28s} python {python}"
                  + ("" if problem is None else f": {problem}"), flush=True)
            failures += problem is not None
    if failures:
        print(f"error: {failures} pinned requirement(s) do not resolve on manylinux x86_64; fix the pin in "
              f"setup.py, tools/ci/pins.py (SPCONV_CUDA) or the Makefile (TORCH_VERSION)", file=sys.stderr)
        return 1
    print(f"all {len(pins)} pins resolve on manylinux x86_64 for the Pythons each serves")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    spconv = sub.add_parser("spconv", help="print the spconv requirement for the installed torch")
    spconv.add_argument("--cuda", help="a torch.version.cuda value instead of the installed torch's ('' = CPU)")
    spconv.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                        help="the Python the wheel is for (default: this one)")
    spconv.add_argument("--glibc", type=parse_glibc, default=None,
                        help="the glibc the wheel must install on, e.g. 2.17 (default: this machine's)")
    checker = sub.add_parser("check", help="resolve every pinned requirement without installing")
    checker.add_argument("--torch", default="2.13.0", help="the torch version the Makefile installs")
    checker.add_argument("--python", default=",".join(PYTHONS),
                         help="comma-separated Pythons for --extra/--only requirements")
    checker.add_argument("--extra", action="append", default=[], help="one more requirement to resolve")
    checker.add_argument("--only", action="append", default=[], help="resolve only these requirements")
    args = parser.parse_args(argv)
    if args.command == "spconv":
        requirement, note = spconv_requirement(installed_torch_cuda() if args.cuda is None else args.cuda,
                                               args.python, args.glibc or machine_glibc())
        print(note, file=sys.stderr)
        print(requirement)
        return 0
    pythons = tuple(args.python.split(","))
    pins = [(req, pythons) for req in args.only] or every_pin(args.torch) + [(req, pythons) for req in args.extra]
    return check(pins)


if __name__ == "__main__":
    sys.exit(main())
