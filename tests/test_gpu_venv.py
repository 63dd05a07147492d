"""tools/ci/gpu_venv.py: `make gpu-check WHEELS=...`'s environment on a machine whose torch is preinstalled.

The layer is built for real, with pip denied the network, over a venv shaped like the lent GPU machines' python3
(/opt/torch/.venv/bin/python3: a venv holding torch, pip, setuptools and wheel), where `venv
--system-site-packages` sees no torch. What to install is decided from installed versions and a wheel folder;
wheel metadata is read from a wheel pip built.
"""
import functools
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "tools" / "ci"))
import gpu_venv  # noqa: E402  (a tool, not a package module: it runs before the package is installed)

TOOL = REPO / "tools" / "ci" / "gpu_venv.py"
REQUIREMENTS = ["numpy>=1.24", "numba==0.68.1", "shapely>=2.0", "spconv-cu126==2.3.8"]


def test_a_need_the_machine_meets_is_left_alone():
    todo = gpu_venv.plan(REQUIREMENTS, {"numpy": "2.5.2", "numba": "0.68.1", "shapely": "2.1.2",
                                        "spconv-cu126": "2.3.8"}, carried={})
    assert todo == gpu_venv.Plan([], [], [])


def test_a_carried_wheel_that_fits_is_installed_and_one_that_does_not_is_not():
    carried = {"shapely": ["2.1.2"], "numba": ["0.61.0"], "spconv-cu126": ["2.3.8"]}
    todo = gpu_venv.plan(REQUIREMENTS, {"numpy": "2.5.2"}, carried)
    assert todo.install == ["shapely>=2.0", "spconv-cu126==2.3.8"]
    assert todo.missing == ["numba==0.68.1"]  # 0.61.0 does not meet the pin
    assert todo.notes == []


def test_the_machines_other_version_is_kept_and_said_when_nothing_carried_fits():
    todo = gpu_venv.plan(["numba==0.68.1", "numpy>=1.24"], {"numba": "0.61.0", "numpy": "1.21.0"},
                         carried={"numpy": ["2.4.6"]})
    assert todo.install == ["numpy>=1.24"]  # the carried numpy shadows the machine's 1.21
    assert todo.missing == []
    assert len(todo.notes) == 1 and todo.notes[0].startswith("numba 0.61.0 kept: setup.py asks ==0.68.1")


def test_a_name_known_without_version_counts_as_met():
    """`--have numba`: the target has it, its version unknown (the device's package list names no versions)."""
    have = gpu_venv.read_have(["numba", "Shapely==2.1.2"], None)
    assert have == {"numba": None, "shapely": "2.1.2"}
    assert gpu_venv.plan(["numba==0.68.1", "shapely>=2.0"], have, {}) == gpu_venv.Plan([], [], [])


def test_the_targets_pip_freeze_is_read(tmp_path):
    freeze = tmp_path / "have.txt"
    freeze.write_text("torch==2.11.0+cu130\nnumpy==2.5.2\n# a comment\n\n"
                      "opencood-ddp @ file:///work/main\nTyping_Extensions==4.16.0\n")
    assert gpu_venv.read_have([], str(freeze)) == {
        "torch": "2.11.0+cu130", "numpy": "2.5.2", "opencood-ddp": None, "typing-extensions": "4.16.0"}


def test_the_runtime_requirements_are_setups_core_and_the_spconv_of_the_targets_cuda():
    core = gpu_venv.core_requirements()
    assert "numba==0.68.1" in core and not any("open3d" in r or "pytest" in r or "torch" in r for r in core)
    assert gpu_venv.runtime_requirements("13.0", "3.12") == core + ["spconv-cu126==2.3.8"]
    assert gpu_venv.runtime_requirements(None, "3.11")[-1] == "spconv==2.3.8"


@pytest.fixture
def built_wheel(tmp_path) -> Path:
    """A wheel pip built from a small project with markers and an extra in its requirements."""
    project = tmp_path / "demo"
    project.mkdir()
    (project / "demo_pkg.py").write_text("ANSWER = 42\n")
    (project / "setup.py").write_text(
        "from setuptools import setup\n"
        "setup(name='demo-pkg', version='1.0', py_modules=['demo_pkg'],\n"
        "      install_requires=['numpy>=1', 'tomli; python_version < \"3.11\"'],\n"
        "      extras_require={'test': ['pytest']})\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp_path / "out"), str(project)], check=True)
    (wheel,) = (tmp_path / "out").glob("*.whl")
    return wheel


def test_a_wheels_requirements_are_those_of_the_targets_python(built_wheel):
    """Requires-Dist with markers and extras: python_version markers follow --python."""
    wheel = built_wheel
    assert gpu_venv.carried_versions(wheel.parent) == {"demo-pkg": ["1.0"]}
    names = {python: [str(r) for r in gpu_venv.wheel_requirements(wheel, gpu_venv.target_environment(python))]
             for python in ("3.10", "3.12")}
    assert names["3.12"] == ["numpy>=1"]
    assert sorted(names["3.10"]) == ['numpy>=1', 'tomli; python_version < "3.11"']


def test_a_plain_system_site_venv_of_a_venv_sees_no_torch(tmp_path):
    """Why the layer exists: this interpreter holds torch in its venv, and a venv made from it with
    --system-site-packages sees only the base interpreter's site-packages."""
    assert sys.prefix != sys.base_prefix, "the test runs in the project's venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(tmp_path / "plain")
    result = subprocess.run([str(tmp_path / "plain" / "bin" / "python"), "-c", "import torch"], capture_output=True)
    assert result.returncode != 0


@functools.lru_cache(maxsize=None)
def no_network_prefix() -> tuple[str, ...]:
    """`unshare -n` (as root) or `unshare -rn` (where user namespaces are allowed): a network namespace without
    interfaces, where nothing resolves or connects. () where neither runs: the environment alone then denies pip."""
    for prefix in (("unshare", "-n"), ("unshare", "-rn")):
        if shutil.which(prefix[0]) and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return ()


def offline(command: list[object], **kwargs) -> subprocess.CompletedProcess:
    """`command` with pip denied every package source: no network (no_network_prefix), no pip setting of this
    machine (its pip.conf and PIP_FIND_LINKS name local wheel folders and indexes), and an index at a closed port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
               PIP_TIMEOUT="3")
    return subprocess.run([*no_network_prefix(), *map(str, command)], capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)


def wheel_of_installed(name: str, folder: Path) -> Path:
    """A wheel of `name` as pip installed it in this venv: its files in site-packages and its dist-info (scripts
    and bytecode left out). Nothing is downloaded: the machine that runs the suite may reach no index."""
    dist = importlib.metadata.distribution(name)
    tag = next(line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines()
               if line.startswith("Tag:"))
    wheel = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in dist.files:
            if file.parts[0] != ".." and file.suffix != ".pyc":
                archive.write(file.locate(), file.as_posix())
    return wheel


def machine_like_base(path: Path, leave_out: set[str]) -> tuple[Path, Path]:
    """A venv over this system's Python holding torch, pip and setuptools (this venv's, linked: a copy of torch
    takes minutes), less the project and `leave_out`, like the GPU machines' python3: its python and site-packages."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    python = path / "bin" / "python"
    site_dir = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        name = entry.name.split("-")[0].lower()
        if name not in leave_out and "opencood" not in name and entry.name != "__pycache__":
            (site_dir / entry.name).symlink_to(entry)
    # Stands for the GPU image's `wheel` package (the device notes list it; it is not on this machine's disk):
    # pip takes the `setup.py develop` route for an editable install when setuptools and wheel both import.
    if not (site_dir / "wheel").exists():
        (site_dir / "wheel").mkdir()
        (site_dir / "wheel" / "__init__.py").write_text("")
    return python, site_dir


def test_a_layer_is_kept_over_the_same_python_and_made_anew_over_another(tmp_path):
    """A layer left by another interpreter is rebuilt, not reused: reused, it read this interpreter's site
    directories with another Python (a rehearsal on 2026-11-29 found a 3.11 layer over torch 2.11's Python 3.12
    site-packages: "Failed to load PyTorch C extensions"). Here the other interpreter is one that is gone, its
    layer's python a link to nothing; another version is not on this machine to stand for it."""
    layer = tmp_path / "layer"
    python = gpu_venv.make_layer(layer)
    kept = layer / "installed_here"
    kept.write_text("")
    assert gpu_venv.make_layer(layer) == python and kept.exists()  # the same Python: kept as it is
    python.unlink()
    python.symlink_to(tmp_path / "an interpreter that is gone")
    assert not gpu_venv.runs_this_python(python)
    assert gpu_venv.make_layer(layer) == python and not kept.exists()  # made anew, whole
    assert gpu_venv.runs_this_python(python)
    subprocess.run([python, "-c", "import torch"], check=True)  # this interpreter's site directories, torch there


@pytest.mark.slow
def test_the_layer_is_made_with_pip_denied_the_network_and_imports_the_checkout(tmp_path):
    """The H200 route with no index: the base lacks tqdm, carried as a packed wheel, and the project goes in
    with no build step. (The editable install through pip failed here: its `setup.py develop` ran a second pip
    that went to the index for setuptools.)"""
    base, base_site = machine_like_base(tmp_path / "base", leave_out={"tqdm"})
    denied = offline([base, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp_path / "got", "tqdm"])
    assert denied.returncode != 0 and not list(tmp_path.glob("got/*")), "pip still reaches a package source"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel_of_installed("tqdm", wheels)
    archive = tmp_path / f"w{gpu_venv.PACK_SUFFIX}"
    gpu_venv.pack_wheels(wheels, archive)
    layer = tmp_path / "layer"
    made = offline([base, TOOL, "make", layer, "--wheels", archive], cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    (installing,) = [line for line in made.stdout.splitlines() if line.startswith("installing from")]
    requirements = installing.rsplit(": ", 1)[1].split(", ")
    assert len(requirements) == 1 and requirements[0].startswith("tqdm")  # only what the base lacks
    probe = ("import json, sys, torch, tqdm, opencood_ddp, importlib.metadata as m\n"
             "print(json.dumps([sys.prefix, torch.__file__, tqdm.__file__, opencood_ddp.__file__,\n"
             "                  m.version('torch'), sys.path]))")
    out = offline([layer / "bin" / "python", "-c", probe], check=True)
    prefix, torch_at, tqdm_at, package_at, torch_version, path = json.loads(out.stdout)
    import torch
    assert Path(prefix) == layer  # pip installed into the layer, not into the machine's environment
    assert Path(tqdm_at).is_relative_to(layer)  # the carried wheel, installed with no network
    assert Path(torch_at).resolve() == Path(torch.__file__).resolve()  # the machine's torch, through the layer
    assert Path(package_at) == REPO / "opencood_ddp" / "__init__.py"  # the checkout itself, not a copy
    assert path.index(str(REPO)) < path.index(str(base_site))  # the checkout before anything the machine holds
    # pip's view too: it will not try to install a torch. (Its public part: torch.__version__ of the CUDA builds the
    # package index serves, the GPU machines' 2.11.0+cu130, has a local label that the wheel's metadata lacks.)
    assert torch_version.split("+")[0] == torch.__version__.split("+")[0]
    again = offline([base, TOOL, "make", layer, "--wheels", wheels], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "installing" not in again.stdout  # the layer has tqdm now


def test_a_missing_wheel_folder_is_one_error_line(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "make", str(tmp_path / "layer"), "--wheels",
                             str(tmp_path / "absent")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: --wheels {tmp_path / 'absent'}")
    assert not (tmp_path / "layer").exists()


def test_a_packed_folder_gives_back_the_same_wheels_and_pip_installs_them(built_wheel, tmp_path):
    """pack -> the one .tar.xz a carrying limit allows -> the wheels rebuilt with the same names and member
    bytes (so each RECORD's hashes hold), which pip installs."""
    archive = tmp_path / f"w{gpu_venv.PACK_SUFFIX}"
    gpu_venv.pack_wheels(built_wheel.parent, archive)
    (rebuilt,) = gpu_venv.unpack_wheels(archive, tmp_path)
    assert rebuilt.name == built_wheel.name and rebuilt != built_wheel
    with zipfile.ZipFile(built_wheel) as before, zipfile.ZipFile(rebuilt) as after:
        assert before.namelist() == after.namelist()
        assert all(before.read(name) == after.read(name) for name in before.namelist())
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), str(rebuilt)], check=True)
    probe = subprocess.run([sys.executable, "-c", "import demo_pkg; print(demo_pkg.ANSWER)"], capture_output=True,
                           text=True, env={"PYTHONPATH": str(target)}, check=True)
    assert probe.stdout.strip() == "42"


def test_an_archive_member_outside_a_wheel_is_refused(tmp_path):
    archive = tmp_path / f"bad{gpu_venv.PACK_SUFFIX}"
    with tarfile.open(archive, "w:xz") as tar:
        entry = tarfile.TarInfo("../escape.txt")
        entry.size = 2
        tar.addfile(entry, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match="is not a wheel member"):
        gpu_venv.unpack_wheels(archive, tmp_path / "out")
    assert not (tmp_path.parent / "escape.txt").exists()


def test_the_target_route_unpacks_the_archive_for_pythonpath_with_pip_denied_the_network(built_wheel, tmp_path):
    """gpu_session's fallback where the layer fails: the carried wheels in a plain folder, no venv; with the
    PYTHONPATH the tool prints, this interpreter imports the carried package, its own torch and the checkout."""
    archive = tmp_path / f"w{gpu_venv.PACK_SUFFIX}"
    gpu_venv.pack_wheels(built_wheel.parent, archive)
    site = tmp_path / "site"
    made = offline([sys.executable, TOOL, "target", site, "--wheels", archive], cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    (ready,) = [line for line in made.stdout.splitlines() if line.startswith("ready: PYTHONPATH=")]
    path = ready.split("=", 1)[1].split(" ", 1)[0]
    assert path == gpu_venv.target_pythonpath(site) == f"{site}{os.pathsep}{REPO}"
    assert (site / "demo_pkg.py").is_file()  # unpacked with no dependency resolved (numpy is not carried)
    probe = subprocess.run([sys.executable, "-c", "import json, demo_pkg, torch, opencood_ddp; "
                            "print(json.dumps([demo_pkg.ANSWER, torch.__file__, opencood_ddp.__file__]))"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}, check=True)
    answer, torch_at, package_at = json.loads(probe.stdout)
    import torch
    assert answer == 42 and Path(torch_at) == Path(torch.__file__)  # the machine's own torch
    assert Path(package_at) == REPO / "opencood_ddp" / "__init__.py"
    with pytest.raises(ImportError):  # nothing went into this interpreter's environment
        __import__("demo_pkg")
