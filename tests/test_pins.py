"""tools/ci/pins.py: the spconv wheel for a torch's CUDA, and `check`, which resolves pins against the package index.

The resolving tests reach the package index (CI does; `make check-pins` resolves every pin of the project);
they ask pip for metadata only, never a wheel.
"""
import subprocess
import sys

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "tools" / "ci"))
import pins  # noqa: E402  (a tool, not a package module: it must run before the package is installed)

PINS = REPO / "tools" / "ci" / "pins.py"


@pytest.mark.parametrize("cuda, python, expected", [
    (None, "3.11", "spconv==2.3.8"),
    ("", "3.12", "spconv==2.3.8"),
    ("11.8", "3.12", "spconv-cu118==2.3.8"),
    ("12.0", "3.11", "spconv-cu120==2.3.6"),  # spconv-cu120 stops at 2.3.6
    ("12.0", "3.12", "spconv-cu118==2.3.8"),  # ... and has no Python 3.12 wheel at all
    ("12.1", "3.11", "spconv-cu121==2.3.8"),
    ("12.2", "3.12", "spconv-cu121==2.3.8"),
    ("12.4", "3.12", "spconv-cu124==2.3.8"),
    ("12.6", "3.11", "spconv-cu126==2.3.8"),
    ("12.8", "3.12", "spconv-cu126==2.3.8"),
    ("13.0", "3.12", "spconv-cu126==2.3.8"),  # no CUDA 13 build: a CUDA 13 driver runs cu126 (run on an H200)
    ("13.0", "3.11", "spconv-cu126==2.3.8"),
    ("11.7", "3.11", "spconv==2.3.8"),  # older than every CUDA build: the CPU wheel, and the note says what it costs
])
def test_spconv_wheel_follows_torch_cuda_and_python(cuda, python, expected):
    requirement, note = pins.spconv_requirement(cuda, python)
    assert requirement == expected
    if cuda == "13.0":
        assert "no CUDA 13 build" in note, note
    if cuda == "11.7":
        assert "SECOND" in note and "cannot run on the GPU" in note, note


def test_every_table_entry_is_checked_for_the_pythons_it_serves():
    checked = dict(pins.every_pin("2.13.0"))
    assert checked["spconv-cu120==2.3.6"] == ("3.11",)
    for name, version, pythons, _ in pins.SPCONV_CUDA.values():
        assert checked[f"{name}=={version}"] == pythons
    assert checked["torch==2.13.0"] == ("3.11", "3.12")
    assert {"numba==0.68.1", "open3d-cpu==0.20.0", "spconv==2.3.8"} <= set(checked)  # setup.py's pins


@pytest.mark.parametrize("cuda, glibc, expected", [
    ("12.6", (2, 28), "spconv-cu126==2.3.8"),
    ("12.6", (2, 27), "spconv-cu121==2.3.8"),  # cu124 and cu126 are manylinux_2_28 wheels only
    ("12.4", (2, 17), "spconv-cu121==2.3.8"),
    ("12.1", (2, 17), "spconv-cu121==2.3.8"),  # cu118, cu120, cu121 and the CPU wheel are manylinux2014
    ("11.8", (2, 17), "spconv-cu118==2.3.8"),
    ("13.0", (2, 17), "spconv-cu121==2.3.8"),
])
def test_spconv_wheel_installs_on_the_machines_glibc(cuda, glibc, expected):
    requirement, note = pins.spconv_requirement(cuda, "3.11", glibc)
    assert requirement == expected
    if glibc < (2, 28) and cuda >= "12.4":
        assert "needs glibc 2.28 or newer" in note and f"here is {glibc[0]}.{glibc[1]}" in note, note


def test_spconv_command_prints_one_requirement():
    result = subprocess.run([sys.executable, PINS, "spconv", "--cuda", "12.4", "--python", "3.12", "--glibc", "2.28"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "spconv-cu124==2.3.8\n", result.stderr
    older = subprocess.run([sys.executable, PINS, "spconv", "--cuda", "12.4", "--python", "3.12", "--glibc", "2.17"],
                           capture_output=True, text=True)
    assert older.returncode == 0 and older.stdout == "spconv-cu121==2.3.8\n", older.stderr
    assert "needs glibc 2.28" in older.stderr


def test_this_machines_glibc_is_read():
    """Against platform.libc_ver(), which reads the interpreter's binary instead of asking the C library."""
    import platform

    library, version = platform.libc_ver()
    expected = tuple(int(part) for part in version.split(".")[:2]) if library == "glibc" else None
    assert pins.machine_glibc() == expected


def test_check_fails_on_a_pin_that_does_not_exist_and_passes_on_one_that_does():
    result = subprocess.run([sys.executable, PINS, "check", "--only", "spconv-cu120==2.3.8",
                             "--only", "spconv-cu121==2.3.8", "--python", "3.12"], capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL spconv-cu120==2.3.8" in result.stdout and "ok   spconv-cu121==2.3.8" in result.stdout
    assert result.stderr.count("error:") == 1 and "fix the pin" in result.stderr
