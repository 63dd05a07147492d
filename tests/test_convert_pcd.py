"""tools/convert_pcd.py and opencood_ddp/data/pcd_convert.py on real files: every converted cloud reads back bit
for bit as its ascii original (read_pcd) and stores each field's values at its SIZE/TYPE, the mirror is a dataset the
project reads with identical samples, and an interrupted or failing run leaves no torn file and resumes."""
from __future__ import annotations

import decimal
import os
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from launch import REPO, clean_environ, explain, in_process
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.pcd import read_pcd, read_pcd_header, write_pcd
from opencood_ddp.data.pcd_convert import (BINARY, CONVERTED, FAILED, MIRROR_MARK, TEMP_SUFFIX, convert_file,
                                           plan_conversion, run_conversion)
from opencood_ddp.errors import ConfigError, DataError
from test_datasets import assert_identical, toy_hypes

TOOL = REPO / "tools" / "convert_pcd.py"


# ---------------------------------------------------------------------------------------------------------------
# Helpers: files written by hand, and an independent reference for what each field must store
# ---------------------------------------------------------------------------------------------------------------


def _pcd_text(fields: str, sizes: str, types: str, counts: str, rows: list[str], width: int | None = None,
              height: int = 1, extra_header: tuple[str, ...] = (), newline: str = "\n") -> bytes:
    points = sum(1 for row in rows if row.strip())
    lines = ["# .PCD v0.7 - written by hand", *extra_header, "VERSION 0.7", f"FIELDS {fields}", f"SIZE {sizes}",
             f"TYPE {types}", f"COUNT {counts}", f"WIDTH {width or points}", f"HEIGHT {height}",
             "VIEWPOINT 1 2 3 1 0 0 0", f"POINTS {points}", "DATA ascii"]
    return (newline.join(lines + rows) + newline).encode("ascii")


def _write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values).view(np.uint32)


def _assert_bit_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _strtof(text: str) -> np.float32:
    """The float32 nearest the decimal text, ties to even (C's strtof), by exact rationals."""
    value = float(text)
    if not np.isfinite(value):
        return np.float32(value)
    exact = Fraction(text)
    if exact == 0:
        return np.float32(-0.0 if text.startswith("-") else 0.0)
    if abs(exact) >= Fraction(2**128 - 2**103):  # float32's overflow threshold (the midpoint past its largest)
        return np.float32(np.inf if exact > 0 else -np.inf)
    with np.errstate(over="ignore"):
        guess = np.float32(value)
    candidates = [c for c in (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
                  if np.isfinite(c)]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(_bits(np.array([c]))[0]) % 2))


def _expected_column(tokens: list[str], kind: str, size: int, read_as_double: bool) -> np.ndarray:
    """What a column must store: F 4 read by read_pcd: float32(strtod); other F 4: strtof; F 8: strtod; I/U: the
    exact integer."""
    if kind == "F" and size == 8:
        return np.array([float(t) for t in tokens], dtype="<f8")
    if kind == "F":
        with np.errstate(over="ignore"):
            values = [np.float32(float(t)) if read_as_double else _strtof(t) for t in tokens]
        return np.array(values, dtype="<f4")
    return np.array([int(Fraction(t)) for t in tokens], dtype=f"<{kind.lower()}{size}")


def _decoded_columns(path: Path) -> list[np.ndarray]:
    """Every column of a binary .pcd, decoded here from the header with numpy (not with the converter's code)."""
    header = read_pcd_header(path)
    raw = path.read_bytes()
    table = np.frombuffer(raw, dtype=np.uint8, count=header.points * header.point_size,
                          offset=header.data_offset).reshape(header.points, header.point_size)
    columns = []
    for field in header.fields:
        dtype = np.dtype(f"<{field.type.lower()}{field.size}")
        for element in range(field.count):
            start = field.offset + element * field.size
            columns.append(np.ascontiguousarray(table[:, start:start + field.size]).view(dtype).ravel())
    return columns


def _assert_converted_like_reference(path: Path, original: bytes) -> None:
    """The file at path is the binary conversion of `original` (its bytes, ascii)."""
    converted = path.read_bytes()
    header_end = original.index(b"DATA ascii")
    assert converted[:header_end] == original[:header_end]  # comments, VIEWPOINT, FIELDS ... POINTS: byte for byte
    assert converted[header_end:header_end + 12] == b"DATA binary\n"
    header = read_pcd_header(path)
    rows = [row.split() for row in original[original.index(b"\n", header_end) + 1:].decode().splitlines()
            if row.strip()]
    names = [field.name for field in header.fields for _ in range(field.count)]
    read_columns = {names.index(name) for name in ("x", "y", "z", "intensity") if name in names}
    column = 0
    decoded = _decoded_columns(path)
    for field in header.fields:
        for _ in range(field.count):
            expected = _expected_column([row[column] for row in rows], field.type, field.size,
                                        column in read_columns)
            assert decoded[column].dtype == expected.dtype
            assert np.array_equal(decoded[column].view(np.uint8), expected.view(np.uint8)), (field.name, column)
            column += 1


def _float32_tie_texts() -> tuple[str, str]:
    """Two decimals whose strtod is exactly a float32 midpoint though the decimals are not: float32(strtod) rounds
    them to even, strtof away from it. The first has 16 digits (the compiled parser's strtod fast path), the second
    60 (left to exact code)."""
    for j in range(1, 100000):
        midpoint = Fraction(1) + Fraction(2 * j + 1, 2**24)
        text = f"{float(midpoint):.16g}"
        if float(text) == float(midpoint) and Fraction(text) != midpoint:
            break
    with decimal.localcontext() as context:
        context.prec = 100
        long_text = str(decimal.Decimal(float(Fraction(1) + Fraction(1, 2**24))) + decimal.Decimal(2) ** -60)
    for candidate in (text, long_text):
        assert _strtof(candidate) != np.float32(float(candidate))  # the case is really exercised
    return text, long_text


TIE, LONG_TIE = _float32_tie_texts()

# name -> (FIELDS, SIZE, TYPE, COUNT, rows): the layouts a converter must store bit for bit.
LAYOUTS = {
    "opv2v_nan_inf": ("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", [
        "-4.091971874 -0.008570218459 -1.908122063 1.382934448e-39",
        "nan 0 0 0", "-nan inf -inf 2.5e-39", "1e39 -1e39 -0 -0",
        "3.4028235677973366e38 1e-46 0.1 3.4028234663852886e38",
        f"{TIE} {LONG_TIE} 0.30000001192092896 {TIE}", f"1 2 3 {LONG_TIE}", "5 6 7 -1.5e-45"]),
    "intensity_field": ("x y z intensity rgb", "4 4 4 4 4", "F F F F F", "1 1 1 1 1", [
        "1.5 2.5 3.5 0.25 2.351988e-38", "nan 1 2 nan 0", "0.1 0.2 0.3 1e-40 1e-40", f"1 1 1 {TIE} {TIE}"]),
    "integers": ("x y z label ring stamp rgb", "2 2 1 1 2 8 4", "I I U U U I U", "1 1 1 1 1 1 1", [
        "-300 12 255 7 65535 1700000000123456789 4294967295", "0 -32768 0 0 0 -9223372036854775808 0",
        "32767 5 17 200 3 9223372036854775807 16777215", "1e2 -5 3 0 0 -1 12345"]),
    "doubles": ("x y z intensity t", "8 8 8 8 8", "F F F F F", "1 1 1 1 1", [
        "0.10000000000000001 -2.2250738585072014e-308 1e-30 0.5 1700000000.1234567",
        "nan inf -0 1e-30 4.9e-324", "1.7976931348623157e308 3.0000000000000004 7 nan -1e300"]),
    "counts_and_extra_fields": ("intensity x y z normal rgba _", "4 8 4 4 4 4 1", "F F F F F U U",
                                "1 2 1 1 3 1 4", [
        "0.5 1.25 99 2.5 3.5 0.1 0.2 0.3 4278190080 0 0 0 0", "nan 1e-30 -1 2 3 nan inf -inf 255 1 2 3 4",
        f"0.75 {TIE} {LONG_TIE} 1 1 {TIE} {LONG_TIE} 1e-45 16711680 9 9 9 9"]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_field_layout_converts_bit_for_bit(tmp_path: Path, name: str) -> None:
    fields, sizes, types, counts, rows = LAYOUTS[name]
    original = _pcd_text(fields, sizes, types, counts, rows)
    path = _write(tmp_path / f"{name}.pcd", original)
    before = read_pcd(path)
    result = convert_file(path)
    assert result.action == CONVERTED and not result.error, result
    assert result.bytes_after == path.stat().st_size
    _assert_bit_equal(read_pcd(path), before)
    _assert_converted_like_reference(path, original)
    assert not list(tmp_path.glob(f"*{TEMP_SUFFIX}"))


def test_crlf_tabs_blank_lines_comments_and_an_organised_cloud(tmp_path: Path) -> None:
    rows = ["1\t2 3 4.5e-39", "", "4 5\t6 1e-38", "7 8 9 0", "-1 -2 -3 3e-39"]
    original = _pcd_text("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", rows, width=2, height=2,
                         extra_header=("# a comment line",), newline="\r\n")[:-2]  # no final newline
    path = _write(tmp_path / "organised.pcd", original)
    before = read_pcd(path)
    assert convert_file(path).action == CONVERTED
    _assert_bit_equal(read_pcd(path), before)
    header = read_pcd_header(path)
    assert (header.width, header.height, header.points, header.data) == (2, 2, 4, "binary")
    assert path.read_bytes().startswith(original[:original.index(b"DATA")])


def test_an_empty_cloud_converts(tmp_path: Path) -> None:
    path = tmp_path / "empty.pcd"
    write_pcd(path, np.zeros((0, 4), dtype=np.float32))
    assert convert_file(path).action == CONVERTED
    assert read_pcd(path).shape == (0, 4) and read_pcd_header(path).data == "binary"


def test_files_written_by_open3d_round_trip(tmp_path: Path) -> None:
    """The form real tools write: open3d's legacy writer (x y z normals, rgb TYPE U) and its tensor writer (F 8
    stamp, U 2 ring, intensity; rows ending in a blank), both with write_ascii=True."""
    open3d = pytest.importorskip("open3d")
    rng = np.random.default_rng(0)
    legacy = open3d.geometry.PointCloud()
    legacy.points = open3d.utility.Vector3dVector(rng.normal(scale=30, size=(500, 3)))
    legacy.normals = open3d.utility.Vector3dVector(rng.normal(size=(500, 3)))
    legacy.colors = open3d.utility.Vector3dVector(rng.random((500, 3)))
    tensor = open3d.t.geometry.PointCloud(open3d.core.Tensor(rng.normal(scale=30, size=(500, 3)).astype(np.float32)))
    tensor.point["intensity"] = open3d.core.Tensor(rng.random((500, 1)).astype(np.float32))
    tensor.point["ring"] = open3d.core.Tensor(rng.integers(0, 128, size=(500, 1)).astype(np.uint16))
    tensor.point["stamp"] = open3d.core.Tensor(1.7e9 + rng.random((500, 1)))
    paths = [tmp_path / "legacy.pcd", tmp_path / "tensor.pcd"]
    assert open3d.io.write_point_cloud(str(paths[0]), legacy, write_ascii=True)
    assert open3d.t.io.write_point_cloud(str(paths[1]), tensor, write_ascii=True)
    for path in paths:
        original = path.read_bytes()
        before = read_pcd(path)
        assert convert_file(path).action == CONVERTED
        _assert_bit_equal(read_pcd(path), before)
        _assert_converted_like_reference(path, original)
    # open3d reads our binary file as it read the ascii one
    ours = open3d.io.read_point_cloud(str(paths[0]))
    assert np.array_equal(np.asarray(ours.points).astype(np.float32), read_pcd(paths[0])[:, :3])


# ---------------------------------------------------------------------------------------------------------------
# Skips, failures, no torn files
# ---------------------------------------------------------------------------------------------------------------


def _cloud(points: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cloud = np.concatenate([rng.normal(scale=20.0, size=(points, 3)), rng.random((points, 1))], axis=1)
    return cloud.astype(np.float32)


def test_binary_and_compressed_files_are_skipped_untouched(tmp_path: Path) -> None:
    open3d = pytest.importorskip("open3d")  # writes the binary_compressed file
    binary = tmp_path / "binary.pcd"
    write_pcd(binary, _cloud(50), binary=True)
    compressed = tmp_path / "compressed.pcd"
    geometry = open3d.geometry.PointCloud()
    geometry.points = open3d.utility.Vector3dVector(_cloud(50)[:, :3].astype(np.float64))
    assert open3d.io.write_point_cloud(str(compressed), geometry, compressed=True)
    for path in (binary, compressed):
        content, stamp = path.read_bytes(), path.stat().st_mtime_ns
        result = convert_file(path)
        assert result.action == BINARY and result.bytes_before == result.bytes_after == len(content)
        assert path.read_bytes() == content and path.stat().st_mtime_ns == stamp


BAD_FILES = {
    # a value binary data cannot hold (a fraction in an integer field), refused before anything is written
    "fraction_in_integer_field.pcd": (
        _pcd_text("x y z ring", "4 4 4 2", "F F F U", "1 1 1 1", ["1 2 3 4", "1 2 3 4.5"]),
        "row 2 has b'4.5' in field 'ring'"),
    "negative_unsigned.pcd": (_pcd_text("x y z ring", "4 4 4 1", "F F F U", "1 1 1 1", ["1 2 3 -1"]),
                              "binary data cannot hold"),
    # read_pcd's own error for a file that is not a valid PCD
    "garbled.pcd": (b"this is not a point cloud\n", "garbled PCD header"),
    "short_body.pcd": (_pcd_text("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", ["1 2 3 0"])[:-4], "row 1 has 2 values"),
    # accepted by the conversion, caught by the read-back check: read_pcd reads an integer -0 as float32 -0.0 from
    # text, but +0.0 from binary, so the binary copy is not bit-equal and is thrown away
    "negative_zero_integer.pcd": (_pcd_text("x y z", "4 4 4", "I I I", "1 1 1", ["1 2 3", "-0 1 1"]),
                                  "does not read back as the original (point 1"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_fails_by_name_and_stays_as_it_was(tmp_path: Path, name: str) -> None:
    content, fragment = BAD_FILES[name]
    path = _write(tmp_path / "in_place" / name, content)
    result = convert_file(path)
    assert result.action == FAILED and result.error.startswith(str(path)) and fragment in result.error, result
    assert path.read_bytes() == content
    # a mirror holds no output for it, not even a stale one of an earlier run
    mirror = _write(tmp_path / "mirror" / name, b"stale output")
    assert convert_file(path, mirror).action == FAILED
    assert not mirror.exists()
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert left == sorted(["in_place", f"in_place/{name}", "mirror"])  # no temporary file either


# ---------------------------------------------------------------------------------------------------------------
# A dataset: in place, mirror, resume
# ---------------------------------------------------------------------------------------------------------------


def _clouds(root: Path) -> dict[Path, np.ndarray]:
    return {path.relative_to(root): read_pcd(path) for path in sorted(root.rglob("*.pcd"))}


def test_toy_world_in_place_on_two_processes_then_nothing_left_to_do(toy_small: Path, tmp_path: Path) -> None:
    root = shutil.copytree(toy_small, tmp_path / "toy")
    before = _clouds(root)
    others = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.suffix != ".pcd"}
    seen = []
    summary = run_conversion(plan_conversion(root), workers=2, on_result=seen.append)
    assert (summary.converted, summary.binary, summary.done, summary.failed) == (len(before), 0, 0, [])
    assert len(seen) == len(before) and summary.bytes_after < summary.bytes_before / 2
    assert summary.bytes_after == sum(p.stat().st_size for p in root.rglob("*.pcd"))
    after = _clouds(root)
    assert after.keys() == before.keys()
    for relative, values in before.items():
        assert read_pcd_header(root / relative).data == "binary"
        _assert_bit_equal(after[relative], values)
    assert {p: p.read_bytes() for p in others} == others
    again = run_conversion(plan_conversion(root), workers=1)
    assert (again.converted, again.binary) == (0, len(before))


def test_plan_orders_biggest_first(tmp_path: Path) -> None:
    for points, name in ((10, "a/small.pcd"), (300, "b/big.pcd"), (100, "c/middle.pcd")):
        (tmp_path / name).parent.mkdir(parents=True)
        write_pcd(tmp_path / name, _cloud(points))
    assert [p.as_posix() for p, _ in plan_conversion(tmp_path).clouds] == ["b/big.pcd", "c/middle.pcd", "a/small.pcd"]


def test_mirror_is_a_dataset_read_with_identical_samples(toy_small: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    source_state = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in toy_small.rglob("*")}
    summary = run_conversion(plan_conversion(toy_small, mirror), workers=2)
    assert summary.converted == len(list(toy_small.rglob("*.pcd"))) and not summary.failed
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in toy_small.rglob("*")} == source_state
    for path in toy_small.rglob("*"):
        twin = mirror / path.relative_to(toy_small)
        if path.suffix == ".pcd":
            assert read_pcd_header(twin).data == "binary"
        elif path.is_file():
            assert twin.samefile(path)  # hard-linked: the mirror costs only the clouds
        else:
            assert twin.is_dir()
    for split, train in (("validate", False), ("train", True)):
        ours = build_dataset(toy_hypes("intermediate", toy_small), split, train, 3)
        theirs = build_dataset(toy_hypes("intermediate", mirror), split, train, 3)
        assert len(ours) == len(theirs)
        for index in (0, len(ours) - 1):
            assert_identical(ours[index], theirs[index])
    again = run_conversion(plan_conversion(toy_small, mirror), workers=1)
    assert (again.converted, again.done) == (0, summary.converted)


def test_mirror_resume_rule_redoes_a_changed_source_and_a_stale_output(tmp_path: Path) -> None:
    root, mirror = tmp_path / "data", tmp_path / "mirror"
    for name in ("a.pcd", "b.pcd", "c.pcd"):
        _write(root / name, b"")
        write_pcd(root / name, _cloud(40, seed=len(name)))
    _write(root / "meta.json", b"{}")
    write_pcd(root / "bin.pcd", _cloud(20), binary=True)
    first = run_conversion(plan_conversion(root, mirror), workers=1)
    assert (first.converted, first.binary, first.others) == (3, 1, 1)
    assert (mirror / "bin.pcd").samefile(root / "bin.pcd")
    # a: the source rewritten after the conversion (newer); b: a truncated output; c: as it was
    write_pcd(root / "a.pcd", _cloud(40, seed=9))
    os.utime(root / "a.pcd", ns=(time.time_ns() + 10**9,) * 2)
    (mirror / "b.pcd").write_bytes((mirror / "b.pcd").read_bytes()[:-5])
    again = run_conversion(plan_conversion(root, mirror), workers=1)
    assert (again.converted, again.done, again.binary) == (2, 1, 1)
    for name in ("a.pcd", "b.pcd", "c.pcd"):
        _assert_bit_equal(read_pcd(mirror / name), read_pcd(root / name))


def test_binary_mirror_beside_a_data_set_is_made_then_reused(tmp_path: Path) -> None:
    """binary_mirror (benchmark_dataset, gpu_check): <root>_binary, completed where a run stopped; a failure names
    the file."""
    from opencood_ddp.data.pcd_convert import binary_mirror

    root = tmp_path / "world"
    for name in ("a.pcd", "b.pcd"):
        _write(root / name, b"")
        write_pcd(root / name, _cloud(30, seed=len(name)))
    mirror = binary_mirror(root, workers=1)
    assert mirror == tmp_path / "world_binary" and read_pcd_header(mirror / "a.pcd").data == "binary"
    (mirror / "b.pcd").unlink()  # a run that stopped before b
    assert binary_mirror(root, workers=1) == mirror and read_pcd_header(mirror / "b.pcd").data == "binary"
    (root / "c.pcd").write_bytes(b"VERSION 0.7\nnot a cloud\n")
    with pytest.raises(DataError, match="c.pcd"):
        binary_mirror(root, workers=1)


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_pcd(_write(root / "s" / "a.pcd", b""), _cloud(30))
    write_pcd(root / "s" / "b.pcd", _cloud(30), binary=True)
    _write(root / "s" / "a.yaml", b"x: 1\n")
    content = (root / "s" / "a.pcd").read_bytes()
    summary = run_conversion(plan_conversion(root, tmp_path / "mirror"), workers=2, dry_run=True)
    assert (summary.converted, summary.binary, summary.others) == (1, 1, 1)
    assert not (tmp_path / "mirror").exists() and (root / "s" / "a.pcd").read_bytes() == content
    in_place = run_conversion(plan_conversion(root), dry_run=True)
    assert in_place.converted == 1 and (root / "s" / "a.pcd").read_bytes() == content


@pytest.mark.parametrize("case", ["missing_root", "out_inside_root", "out_is_root", "root_inside_out", "no_clouds"])
def test_bad_requests_are_one_line(tmp_path: Path, case: str) -> None:
    root = tmp_path / "data"
    write_pcd(_write(root / "a.pcd", b""), _cloud(5))
    _write(tmp_path / "empty" / "notes.txt", b"")
    root_arg, out, error, fragment = {
        "missing_root": (tmp_path / "nope", None, DataError, "dataset folder not found"),
        "out_inside_root": (root, root / "bin", ConfigError, "is inside the dataset root"),
        "out_is_root": (root, root, ConfigError, "is inside the dataset root"),
        "root_inside_out": (root, tmp_path, ConfigError, "holds the dataset root"),
        "no_clouds": (tmp_path / "empty", None, DataError, "no .pcd file below"),
    }[case]
    with pytest.raises(error, match=fragment) as raised:
        plan_conversion(root_arg, out)
    assert "\n" not in str(raised.value)


def test_workers_must_be_at_least_one(tmp_path: Path) -> None:
    write_pcd(_write(tmp_path / "a.pcd", b""), _cloud(5))
    with pytest.raises(ConfigError, match="--workers 0"):
        run_conversion(plan_conversion(tmp_path), workers=0)


def test_the_tools_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    result = in_process(TOOL, str(tmp_path / "nope"))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, explain(result)
    assert result.stderr.startswith(f"error: {tmp_path / 'nope'}: dataset folder not found")
    write_pcd(_write(tmp_path / "data" / "a.pcd", b""), _cloud(5))
    result = in_process(TOOL, str(tmp_path / "data"), "--out", str(tmp_path / "data" / "bin"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "choose a folder outside" in result.stderr


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as handle:
        return b"DATA binary" in handle.read(400)


def test_killed_run_leaves_no_torn_file_and_the_cli_resumes_with_a_summary(tmp_path: Path) -> None:
    """A real `tools/convert_pcd.py` process killed (SIGKILL) in the middle of a run: every cloud is its original or
    a verified conversion; the next run removes the temporary files, converts the rest and skips the done ones, and
    its summary and exit status report the one bad file."""
    root = tmp_path / "data"
    template = _write(root / "template.pcd", b"")
    write_pcd(template, _cloud(20000, seed=1))
    originals = {}
    for index in range(40):
        path = root / f"s{index % 4}" / "cav" / f"{index:06d}.pcd"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        originals[path] = path.read_bytes()
    template.unlink()
    write_pcd(_write(root / "s0" / "cav" / "binary.pcd", b""), _cloud(100), binary=True)
    bad = _write(root / "s1" / "cav" / "bad.pcd", b"not a point cloud at all\n")
    reference = read_pcd(next(iter(originals)))

    with open(tmp_path / "out.txt", "w") as out:
        process = subprocess.Popen([sys.executable, str(TOOL), str(root), "--workers", "1"], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO, env=clean_environ())
        deadline = time.monotonic() + 120
        while not any(_is_binary(p) for p in originals) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
    converted_first = [p for p in originals if _is_binary(p)]
    assert 0 < len(converted_first) < len(originals), (tmp_path / "out.txt").read_text()
    for path, content in originals.items():  # never torn: the original bytes, or a verified conversion
        if _is_binary(path):
            _assert_bit_equal(read_pcd(path), reference)
        else:
            assert path.read_bytes() == content

    result = subprocess.run([sys.executable, str(TOOL), str(root), "--workers", "2"], capture_output=True,
                            text=True, timeout=300, cwd=REPO, env=clean_environ())
    assert result.returncode == 1, explain(result)
    skipped = len(converted_first) + 1  # and the binary file
    assert (f"converted {len(originals) - len(converted_first)} .pcd files; skipped {skipped} (already binary) "
            "and 0 (converted by an earlier run); failed 1") in result.stdout, explain(result)
    assert ".pcd bytes:" in result.stdout and "worker process(es)" in result.stdout
    assert f"failed: {bad}: garbled PCD header" in result.stderr, explain(result)
    assert "Traceback" not in result.stderr
    assert not [p for p in root.rglob("*") if p.name.endswith(TEMP_SUFFIX)]
    assert bad.read_bytes() == b"not a point cloud at all\n"
    for path in originals:
        assert _is_binary(path)
        _assert_bit_equal(read_pcd(path), reference)


def test_leftover_temporary_files_are_never_mirrored_and_are_removed_where_the_run_writes(tmp_path: Path) -> None:
    root, mirror = tmp_path / "data", tmp_path / "mirror"
    write_pcd(_write(root / "a.pcd", b""), _cloud(10))
    left_in_root = _write(root / f".a.pcd.x1y2{TEMP_SUFFIX}", b"half a file")
    left_in_mirror = _write(mirror / f".a.pcd.z3{TEMP_SUFFIX}", b"half a file")
    summary = run_conversion(plan_conversion(root, mirror), workers=1)
    assert summary.leftovers_removed == 1 and not left_in_mirror.exists()
    assert left_in_root.exists() and not (mirror / left_in_root.name).exists()  # the source is only read
    summary = run_conversion(plan_conversion(root), workers=1)
    assert summary.leftovers_removed == 1 and not left_in_root.exists()


def test_a_mirror_replaces_no_file_it_did_not_write(tmp_path: Path) -> None:
    """--out into an existing folder: a file there at a path of the dataset, different from the dataset's, may be
    someone's own (it was replaced without a word); a mirror is known by its mark, or by holding only what a mirror
    of this root holds (one of an earlier version, made before the mark)."""
    root, mirror, other = tmp_path / "data", tmp_path / "mirror", tmp_path / "other"
    write_pcd(_write(root / "s" / "a.pcd", b""), _cloud(10))
    _write(root / "s" / "a.yaml", b"x: 1\n")
    notes = _write(mirror / "s" / "a.yaml", b"my notes\n")
    with pytest.raises(ConfigError, match=f"holds {mirror / 's' / 'a.yaml'}, which differs from the dataset's"):
        plan_conversion(root, mirror)
    assert notes.read_text() == "my notes\n" and not (mirror / MIRROR_MARK).exists()

    notes.unlink()
    mine = _write(mirror / "s" / "a.pcd", b"")  # a cloud of someone's at a cloud's path: not the conversion
    write_pcd(mine, _cloud(10, seed=7), binary=True)
    with pytest.raises(ConfigError, match=f"holds {mine}, which differs"):
        plan_conversion(root, mirror)
    mine.unlink()
    first = run_conversion(plan_conversion(root, mirror), workers=1)
    assert first.converted == 1 and (mirror / MIRROR_MARK).read_text().strip() == str(root.resolve())
    (mirror / MIRROR_MARK).unlink()  # as a mirror made before the mark: taken, since nothing of it differs
    again = run_conversion(plan_conversion(root, mirror), workers=1)
    assert (again.converted, again.done) == (0, 1) and (mirror / MIRROR_MARK).is_file()

    write_pcd(_write(other / "s" / "a.pcd", b""), _cloud(10, seed=3))
    with pytest.raises(ConfigError, match=f"is the mirror of {root.resolve()}, not of {other}"):
        plan_conversion(other, mirror)
    # a mirror of the mirror gets a mark of its own, not a link to the first one's
    run_conversion(plan_conversion(mirror, tmp_path / "second"), workers=1)
    assert (tmp_path / "second" / MIRROR_MARK).read_text().strip() == str(mirror.resolve())
    assert (mirror / MIRROR_MARK).read_text().strip() == str(root.resolve())
