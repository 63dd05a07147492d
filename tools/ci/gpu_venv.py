#!/usr/bin/env python
"""`make gpu-check` on a machine whose CUDA torch is preinstalled and that reaches no package index.

    python3 tools/ci/gpu_venv.py make .venv-gpu --wheels WHEELS      # there (the Makefile's gpu-venv)
    python3 tools/ci/gpu_venv.py download WHEELS --python 3.12 --cuda 13.0 --have-file have.txt   # where pip works
    python3 tools/ci/gpu_venv.py pack WHEELS w.wheels.tar.xz     # one xz file, smaller; make --wheels takes it too
    python3 tools/ci/gpu_venv.py target SITE --wheels WHEELS      # no venv: runs take PYTHONPATH=SITE:<checkout>

`make` builds a venv layered over the interpreter that runs it (the one holding torch) and installs into it, from
the folder WHEELS alone, what the project needs and that interpreter lacks; then the project itself, as a .pth
line naming the checkout: no build step, so no build backend is needed (see install_checkout).
`download` fills such a folder for another machine: the wheels of the project's run-time requirements and of
spconv for that machine's Python and CUDA, with their dependencies, less what the machine already has
(`have.txt` is its `python3 -m pip list --format=freeze`).
`target` is the fallback where `make` fails on a machine: the wheels unpacked into a plain folder
(pip --target --no-deps), which runs put on PYTHONPATH before the checkout (gpu_session.py takes it by itself).

Why a layer and not `python -m venv --system-site-packages`: that flag shows the new venv the *base*
interpreter's site-packages. Where torch lives in a venv itself (the lent GPU machines' python3 is
/opt/torch/.venv/bin/python3, and cluster module systems do the same), a venv made from it sees neither torch
nor pip. The layer lists the creating interpreter's site directories in a .pth file, after its own
site-packages, so what is installed into the layer shadows the machine's and the rest is the machine's. It is
made without ensurepip (Debian's python3 has none unless python3-venv is installed): pip comes from the
machine's environment through the same .pth.

Run-time requirements only: setup.py's CORE and spconv. The test extra and open3d (read by one test only, and
over the size anything can be carried in) stay out; gpu_check needs neither. Standard library, pip and
packaging only, so that it runs before the project is installed.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import lzma
import os
import re
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import venv
import zipfile
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pins  # noqa: E402  (beside this file; the spconv table and the platform tags)

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip vendors it where it is not installed on its own
    from pip._vendor.packaging.markers import default_environment  # type: ignore
    from pip._vendor.packaging.requirements import Requirement  # type: ignore
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore

ROOT = pins.ROOT
LAYER_PTH = "machine_site.pth"
# site reads a folder's .pth files in name order: the checkout's line comes before the machine's directories, so an
# opencood_ddp the machine may hold cannot shadow the checkout.
CHECKOUT_PTH = "checkout_opencood_ddp.pth"
WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


class Plan(NamedTuple):
    """What `make` does with each run-time requirement."""

    install: list[str]  # requirements to install from the wheel folder
    notes: list[str]  # requirements kept as the machine has them, and why
    missing: list[str]  # requirements neither the machine nor the folder has


def core_requirements(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """setup.py's CORE list, read from its literal (not by running setup.py)."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CORE" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{setup_py} has no CORE list")


def runtime_requirements(cuda: Optional[str], python: str) -> list[str]:
    """CORE and the spconv wheel for torch.version.cuda `cuda` on `python` (tools/ci/pins.py's table)."""
    return core_requirements() + [pins.spconv_requirement(cuda, python)[0]]


def carried_versions(folder: Path) -> dict[str, list[str]]:
    """Canonical name -> the versions of the wheels in `folder`."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.whl")):
        match = WHEEL_NAME.match(path.name)
        if match:
            found.setdefault(canonicalize_name(match["name"]), []).append(match["version"])
    return found


def satisfied(requirement: Requirement, version: Optional[str]) -> bool:
    """Whether an installed `version` (None: installed, version unknown) meets the requirement's specifier."""
    return version is None or requirement.specifier.contains(version, prereleases=True)


def plan(requirements: Sequence[str], installed: dict[str, Optional[str]], carried: dict[str, list[str]]) -> Plan:
    """For each requirement: nothing when the machine meets it; install it when the folder holds a wheel that
    does; keep the machine's other version (noted) when the folder does not; missing when neither has it."""
    result = Plan([], [], [])
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        present, have = name in installed, installed.get(name)
        if present and satisfied(requirement, have):
            continue
        if any(satisfied(requirement, v) for v in carried.get(name, [])):
            result.install.append(text)
        elif present:
            result.notes.append(f"{requirement.name} {have} kept: setup.py asks {requirement.specifier} and the "
                                f"wheel folder has none that fits")
        else:
            result.missing.append(text)
    return result


# ---------------------------------------------------------------------------------------------------------- make
def interpreter_site_dirs() -> list[str]:
    """This interpreter's site directories, in its own order (a venv's site-packages; a system Python's
    dist-packages)."""
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.isdir(d)]


def make_layer(path: Path) -> Path:
    """The layer's python: a venv at `path` without pip, whose .pth adds this interpreter's site directories. A
    layer already there is kept only if it runs this interpreter's Python (`runs_this_python`): one made over
    another (a machine's python3 replaced, an earlier rehearsal's) would read this one's site directories with
    another Python, and its torch would not import ("Failed to load PyTorch C extensions")."""
    python = path / "bin" / "python"
    if not runs_this_python(python):
        # clear: a venv over another Python goes whole, with what was installed into it for that Python
        venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True,
                        clear=(path / "pyvenv.cfg").exists()).create(path)
    (layer_purelib(python) / LAYER_PTH).write_text("".join(f"{d}\n" for d in interpreter_site_dirs()))
    return python


def runs_this_python(python: Path) -> bool:
    """Whether `python` exists and runs the Python this process runs on: the same base installation and version."""
    if not python.exists():
        return False
    try:
        seen = run_in(python, "import sys; print(sys.base_prefix); print(sys.version)")
    except (OSError, RuntimeError):  # a link to an interpreter that is gone, or one that fails to start
        return False
    return seen == f"{sys.base_prefix}\n{sys.version}\n"


def layer_purelib(python: Path) -> Path:
    """The layer's site-packages, where its .pth files go."""
    return Path(run_in(python, "import sysconfig; print(sysconfig.get_path('purelib'))").strip())


def run_in(python: Path, code: str, env: Optional[dict] = None) -> str:
    """`code`'s stdout in `python`; RuntimeError with the last line of its stderr where it fails."""
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    return result.stdout


def layer_state(python: Path, names: Iterable[str]) -> dict:
    """torch's version and CUDA as the layer sees them, and the installed version of each name (or absent)."""
    code = ("import json, sys, importlib.metadata as m\n"
            "import torch\n"
            "found = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: found[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'installed': found}))\n")
    result = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {sys.executable} has no importable torch ({result.stderr.strip().splitlines()[-1]}); "
                         f"run this with the interpreter that holds the machine's CUDA torch (make gpu-check "
                         f"WHEELS=... PYTHON=/path/to/that/python3)")
    state = json.loads(result.stdout)
    state["installed"] = {canonicalize_name(k): v for k, v in state["installed"].items()}
    return state


def pip_offline(python: Path, *install_args: str) -> None:
    """`pip install *install_args` by `python` from local wheels alone, whatever the machine's pip settings say.

    --no-index: no package index. --only-binary=:all: refuses a source archive rather than build it (a build wants
    its build dependencies, setuptools first, from an index). --isolated and PIP_CONFIG_FILE=/dev/null: no PIP_*
    variable and no pip.conf applies, since --no-index leaves their find-links (which may be URLs) and their
    user/target/prefix (which would install elsewhere) in force."""
    command = [str(python), "-m", "pip", "--isolated", "install", "-q", "--disable-pip-version-check", "--no-index",
               "--only-binary=:all:", *install_args]
    subprocess.run(command, check=True, env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))


def pip_install(python: Path, wheels: Path, requirements: Sequence[str]) -> None:
    """`requirements` installed into the layer from the folder `wheels`, their dependencies resolved there."""
    pip_offline(python, "--find-links", str(wheels), *requirements)


def install_checkout(python: Path) -> Path:
    """The project in the layer without pip: a .pth line naming the checkout.

    opencood_ddp is pure Python, with no entry points, compiled parts or package data, and reads no metadata of its
    own: what an editable install gives it at run time is this sys.path entry (`setup.py develop` wrote the same
    line before setuptools 80). Through pip it needs a build backend, which the machine may lack or which may route
    around --no-index: where setuptools and wheel import, pip runs `setup.py develop`, and setuptools 80 and later
    make that a second `pip install -e . --use-pep517` without the caller's flags, which fetches setuptools from an
    index for its isolated build (the H200 failure)."""
    pth = layer_purelib(python) / CHECKOUT_PTH
    pth.write_text(f"{ROOT}\n")
    return pth


def with_wheel_folder(args: argparse.Namespace, then) -> int:
    """then(folder of wheels, args): --wheels itself, or its `pack` archive unpacked into a scratch folder."""
    wheels = Path(args.wheels)
    if wheels.is_file() and wheels.name.endswith(PACK_SUFFIX):
        with tempfile.TemporaryDirectory() as scratch:
            unpack_wheels(wheels, Path(scratch))
            return then(Path(scratch), args)
    if not wheels.is_dir():
        print(f"error: --wheels {wheels} is neither a folder nor a {PACK_SUFFIX} of `gpu_venv.py pack`; make it "
              f"with `python3 tools/ci/gpu_venv.py download` where pip reaches an index, and carry it here",
              file=sys.stderr)
        return 2
    return then(wheels, args)


def needs_met(python: Path, wheels: Path) -> tuple[dict, Optional[Plan]]:
    """`python`'s torch state and the plan for the run-time requirements, or (state, None) after an error line
    when neither the machine nor `wheels` meets one of them (spconv only noted: SECOND and its check skip)."""
    python_version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    names = [Requirement(r).name for r in core_requirements()] + [n for n, *_ in pins.SPCONV_CUDA.values()]
    state = layer_state(python, names + ["spconv"])
    requirements = runtime_requirements(state["cuda"], python_version)
    todo = plan(requirements, state["installed"], carried_versions(wheels))
    for note in todo.notes:
        print(f"note: {note}")
    spconv = requirements[-1]
    hard = [r for r in todo.missing if r != spconv]
    if spconv in todo.missing:
        print(f"note: no {spconv} on this machine or in {wheels}: gpu_check's spconv check and SECOND will skip")
    if hard:
        print(f"error: neither this machine nor {wheels} has {', '.join(hard)}; add their wheels to the folder "
              f"(tools/ci/gpu_venv.py download, with this machine's pip list as --have-file)", file=sys.stderr)
        return state, None
    return state, todo


def make_from(wheels: Path, args: argparse.Namespace) -> int:
    python = make_layer(Path(args.venv))
    state, todo = needs_met(python, wheels)
    print(f"layer {args.venv} over {sys.executable}: torch {state['torch']}, CUDA {state['cuda']}")
    if todo is None:
        return 2
    if todo.install:
        print(f"installing from {wheels}: {', '.join(todo.install)}")
        pip_install(python, wheels, todo.install)
    pth = install_checkout(python)
    package = run_in(python, "import opencood_ddp; print(opencood_ddp.__file__)").strip()
    print(f"ready: {python} imports torch {state['torch']} and {package} (through {pth.name}, no build step)")
    return 0


# -------------------------------------------------------------------------------------------------------- target
# The route of the device notes from before the layer: no venv at all. Every wheel of the folder (`download
# --have-file` left in it only what the machine lacks) unpacked into a plain folder with pip's --target and
# --no-deps, which a run puts on PYTHONPATH before the checkout. gpu_session.py takes it where `make` fails on a
# lent machine, so that a failed layer does not cost the machine's few minutes.
def target_pythonpath(folder: Path) -> str:
    """The PYTHONPATH of a run on the target route: the wheels' folder, then the checkout."""
    return os.pathsep.join([str(folder), str(ROOT)])


def target_from(wheels: Path, args: argparse.Namespace) -> int:
    folder = Path(args.folder).resolve()
    state, todo = needs_met(Path(sys.executable), wheels)
    print(f"target {folder} for {sys.executable}: torch {state['torch']}, CUDA {state['cuda']}")
    if todo is None:
        return 2
    files = sorted(wheels.glob("*.whl"))
    if files:
        print(f"unpacking {len(files)} wheels: {', '.join(f.name for f in files)}")
        pip_offline(Path(sys.executable), "--no-deps", "--upgrade", "--target", str(folder), *map(str, files))
    path = target_pythonpath(folder)
    try:
        package = run_in(Path(sys.executable), "import torch, opencood_ddp; print(opencood_ddp.__file__)",
                         env=dict(os.environ, PYTHONPATH=path)).strip()
    except RuntimeError as error:
        print(f"error: with PYTHONPATH={path}, {sys.executable} cannot import the project: {error}", file=sys.stderr)
        return 2
    print(f"ready: PYTHONPATH={path} {sys.executable} imports torch {state['torch']} and {package}")
    return 0


# ---------------------------------------------------------------------------------------------------------- pack
# A wheel is a zip whose members are deflated one by one; spconv-cu126's is 67 MiB, over the 64 MiB a call to a
# lent GPU machine carries. The members themselves (353 MB for the 9 wheels a CUDA 13 machine lacks) compress to
# 39 MiB with xz across files. `pack` stores each wheel's members, in their order, under the wheel's file name in
# one .tar.xz; `make` rebuilds the wheels from it: the same file names and member bytes, so the hashes in each
# wheel's RECORD still hold.
PACK_SUFFIX = ".wheels.tar.xz"


def pack_wheels(folder: Path, archive: Path) -> None:
    with tarfile.open(archive, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for wheel in sorted(folder.glob("*.whl")):
            with zipfile.ZipFile(wheel) as source:
                for member in source.infolist():
                    if member.is_dir():
                        continue
                    data = source.read(member)
                    entry = tarfile.TarInfo(f"{wheel.name}/{member.filename}")
                    entry.size, entry.mode = len(data), 0o644
                    tar.addfile(entry, io.BytesIO(data))


def unpack_wheels(archive: Path, folder: Path) -> list[Path]:
    """The wheels of a `pack` archive, rebuilt in `folder`. Members are read as data, never extracted by path."""
    wheels: dict[str, zipfile.ZipFile] = {}
    try:
        with tarfile.open(archive, "r:xz") as tar:
            for entry in tar:
                name, _, member = entry.name.partition("/")
                if not entry.isfile() or not name.endswith(".whl") or "/" in name or not member:
                    raise ValueError(f"{archive}: {entry.name!r} is not a wheel member of `gpu_venv.py pack`")
                if name not in wheels:
                    wheels[name] = zipfile.ZipFile(folder / name, "w", zipfile.ZIP_DEFLATED)
                wheels[name].writestr(member, tar.extractfile(entry).read())
    finally:
        for wheel in wheels.values():
            wheel.close()
    return [folder / name for name in wheels]


# ------------------------------------------------------------------------------------------------------ download
def read_have(names: Sequence[str], freeze_file: Optional[str]) -> dict[str, Optional[str]]:
    """Canonical name -> version (None: any) of what the target machine has: `--have` names (NAME or
    NAME==VERSION) and the lines of a `pip list --format=freeze` file."""
    entries = list(names)
    if freeze_file:
        entries += [line.strip() for line in Path(freeze_file).read_text().splitlines()]
    have: dict[str, Optional[str]] = {}
    for entry in entries:
        if not entry or entry.startswith("#"):
            continue
        name, _, version = entry.partition("==")
        have[canonicalize_name(name.split(" @ ")[0].strip())] = version.strip() or None
    return have


def target_environment(python: str) -> dict[str, str]:
    """The marker environment of CPython `python` on manylinux x86_64."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")
    return env


def wheel_requirements(path: Path, environment: dict) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the target (no extras)."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode("utf-8", "replace").splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            marker_env = dict(environment, extra="")
            if requirement.marker is None or requirement.marker.evaluate(marker_env):
                found.append(requirement)
    return found


def download_one(requirement: str, folder: Path, python: str) -> Path:
    """One wheel (no dependencies) of `requirement` for CPython `python` on manylinux x86_64, into `folder`."""
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        *pins.wheel_target_args(python), "-d", scratch, requirement], check=True)
        (wheel,) = Path(scratch).glob("*.whl")
        target = folder / wheel.name
        wheel.replace(target)
    return target


def cmd_download(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    have = read_have(args.have, args.have_file)
    environment = target_environment(args.python)
    queue = [Requirement(r) for r in runtime_requirements(args.cuda, args.python)]
    taken: dict[str, str] = {}
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name == "torch" or name in taken or (name in have and satisfied(requirement, have[name])):
            continue
        wheel = download_one(str(requirement).split(";")[0], folder, args.python)
        taken[name] = wheel.name
        print(f"{wheel.name} ({wheel.stat().st_size / 2 ** 20:.1f} MiB)")
        queue += wheel_requirements(wheel, environment)
    total = sum((folder / w).stat().st_size for w in taken.values()) / 2 ** 20
    print(f"{len(taken)} wheels, {total:.1f} MiB, in {folder}; on the target: make gpu-check WHEELS={folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    maker = sub.add_parser("make", help="the venv layered over this interpreter, with what it lacks installed")
    maker.add_argument("venv", help="the layer's folder, e.g. .venv-gpu")
    maker.add_argument("--wheels", required=True, help="the folder of wheels to install from (no package index)")
    target = sub.add_parser("target", help="no venv: the wheels unpacked into a folder for PYTHONPATH (fallback)")
    target.add_argument("folder", help="the folder to unpack into, e.g. /tmp/gpu_session/site")
    target.add_argument("--wheels", required=True, help="the folder of wheels or its pack archive")
    fetcher = sub.add_parser("download", help="the wheels another machine needs, for its Python and CUDA")
    fetcher.add_argument("folder")
    fetcher.add_argument("--python", required=True, help="the target's Python, e.g. 3.12")
    fetcher.add_argument("--cuda", required=True, help="the target torch's torch.version.cuda, e.g. 13.0 ('' = CPU)")
    fetcher.add_argument("--have", nargs="*", default=[], help="NAME or NAME==VERSION the target already has")
    fetcher.add_argument("--have-file", help="the target's `python3 -m pip list --format=freeze`")
    packer = sub.add_parser("pack", help=f"a folder of wheels as one {PACK_SUFFIX}, for a carrying limit")
    packer.add_argument("folder")
    packer.add_argument("archive", help=f"the file to write, ending in {PACK_SUFFIX}")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "pack":
        if not args.archive.endswith(PACK_SUFFIX):
            parser.error(f"the archive's name must end in {PACK_SUFFIX} (make --wheels knows it by that)")
        pack_wheels(Path(args.folder), Path(args.archive))
        print(f"{args.archive}: {Path(args.archive).stat().st_size / 2 ** 20:.1f} MiB")
        return 0
    if args.command == "download":
        return cmd_download(args)
    return with_wheel_folder(args, make_from if args.command == "make" else target_from)


if __name__ == "__main__":
    sys.exit(main())
