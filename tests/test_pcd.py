"""read_pcd / write_pcd against open3d, on files open3d wrote, files we wrote and files written by hand."""

from __future__ import annotations

import ctypes
import math
import os
import struct
import subprocess
import sys
from decimal import Decimal, getcontext
from pathlib import Path

import numpy as np
import pytest

from opencood_ddp.data import pcd
from opencood_ddp.data.pcd import read_pcd, read_pcd_header, write_pcd
from opencood_ddp.errors import DataError

open3d = pytest.importorskip("open3d")


def _cloud(points: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cloud = np.empty((points, 4), dtype=np.float32)
    cloud[:, :3] = rng.uniform(-120.0, 120.0, (points, 3))
    cloud[: points // 10, :3] *= 1e-6  # tiny coordinates print with an exponent
    cloud[:, 3] = rng.random(points)
    if points >= 5:
        cloud[:5, 3] = [0.0, 1.0, 0.5 / 255, 127.5 / 255, 0.999]
    return cloud


def _open3d_write(path: Path, cloud: np.ndarray, ascii_data: bool, compressed: bool = False) -> None:
    geometry = open3d.geometry.PointCloud()
    geometry.points = open3d.utility.Vector3dVector(cloud[:, :3].astype(np.float64))
    geometry.colors = open3d.utility.Vector3dVector(np.repeat(cloud[:, 3:4].astype(np.float64), 3, axis=1))
    assert open3d.io.write_point_cloud(str(path), geometry, write_ascii=ascii_data, compressed=compressed)


def _open3d_read(path: Path) -> np.ndarray:
    """What read_pcd must reproduce bit for bit: open3d's points and red colour, cast to float32."""
    geometry = open3d.io.read_point_cloud(str(path))
    out = np.zeros((len(geometry.points), 4), dtype=np.float32)
    with np.errstate(over="ignore"):
        out[:, :3] = np.asarray(geometry.points)
    if geometry.has_colors():
        out[:, 3] = np.asarray(geometry.colors)[:, 0]
    return out


def _assert_same(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    # Bit for bit, NaN included.
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


def _write_text(path: Path, header_lines: list[str], rows: list[str]) -> Path:
    path.write_text("\n".join(header_lines + rows) + "\n")
    return path


def _header(fields: str, sizes: str, types: str, counts: str, points: int, data: str = "ascii") -> list[str]:
    return ["VERSION 0.7", f"FIELDS {fields}", f"SIZE {sizes}", f"TYPE {types}", f"COUNT {counts}",
            f"WIDTH {points}", "HEIGHT 1", "VIEWPOINT 0 0 0 1 0 0 0", f"POINTS {points}", f"DATA {data}"]


# --------------------------------------------------------------------------------------------------------------
# Files open3d wrote
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ascii_data, compressed", [(True, False), (False, False), (False, True)],
                         ids=["ascii", "binary", "binary_compressed"])
def test_matches_open3d_on_open3d_files(tmp_path: Path, ascii_data: bool, compressed: bool) -> None:
    cloud = _cloud(20_000)
    cloud[7, 0] = np.nan  # open3d keeps non-finite points by default; so do we
    cloud[8, 1] = np.inf
    path = tmp_path / "cloud.pcd"
    _open3d_write(path, cloud, ascii_data, compressed)
    ours = read_pcd(path)
    _assert_same(ours, _open3d_read(path))
    assert np.isnan(ours[7, 0]) and np.isinf(ours[8, 1])
    assert len(ours) == len(cloud)


def test_open3d_file_without_colours_has_zero_intensity(tmp_path: Path) -> None:
    geometry = open3d.geometry.PointCloud()
    geometry.points = open3d.utility.Vector3dVector(_cloud(100)[:, :3].astype(np.float64))
    path = tmp_path / "plain.pcd"
    open3d.io.write_point_cloud(str(path), geometry, write_ascii=True)
    ours = read_pcd(path)
    _assert_same(ours, _open3d_read(path))
    assert not ours[:, 3].any()


# --------------------------------------------------------------------------------------------------------------
# Files we wrote
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["ascii", "binary"])
def test_writer_output_reads_the_same_in_open3d_and_round_trips(tmp_path: Path, binary: bool) -> None:
    cloud = _cloud(20_000, seed=1)
    path = tmp_path / "ours.pcd"
    write_pcd(path, cloud, binary=binary)
    ours = read_pcd(path)
    _assert_same(ours, _open3d_read(path))
    assert np.array_equal(ours[:, :3], cloud[:, :3])
    # Intensity is stored as a byte: round half away from zero, like open3d.
    expected_byte = np.floor(cloud[:, 3].astype(np.float64) * 255 + 0.5)
    assert np.array_equal(ours[:, 3], (expected_byte / 255.0).astype(np.float32))
    assert ours[:5, 3].tolist() == pytest.approx([0.0, 1.0, 1 / 255, 128 / 255, 255 / 255])


@pytest.mark.parametrize("binary", [False, True], ids=["ascii", "binary"])
def test_writer_header_is_open3d_layout(tmp_path: Path, binary: bool) -> None:
    path = tmp_path / "ours.pcd"
    write_pcd(path, _cloud(3), binary=binary)
    head = path.read_bytes().split(b"\n")[:11]
    assert head == [
        b"# .PCD v0.7 - Point Cloud Data file format", b"VERSION 0.7", b"FIELDS x y z rgb", b"SIZE 4 4 4 4",
        b"TYPE F F F F", b"COUNT 1 1 1 1", b"WIDTH 3", b"HEIGHT 1", b"VIEWPOINT 0 0 0 1 0 0 0", b"POINTS 3",
        b"DATA binary" if binary else b"DATA ascii",
    ]


def test_binary_writer_packs_colour_like_open3d(tmp_path: Path) -> None:
    cloud = _cloud(500, seed=2)
    ours, theirs = tmp_path / "ours.pcd", tmp_path / "theirs.pcd"
    write_pcd(ours, cloud, binary=True)
    _open3d_write(theirs, cloud, ascii_data=False)
    # Same data bytes; open3d 0.20 only labels the colour TYPE U instead of F.
    assert ours.read_bytes().split(b"DATA binary\n", 1)[1] == theirs.read_bytes().split(b"DATA binary\n", 1)[1]


def test_writer_clamps_and_zeroes_nan_intensity(tmp_path: Path) -> None:
    cloud = np.zeros((4, 4), dtype=np.float32)
    cloud[:, 3] = [-0.5, 1.5, np.nan, 0.25]
    path = tmp_path / "clamp.pcd"
    write_pcd(path, cloud)
    assert read_pcd(path)[:, 3].tolist() == pytest.approx([0.0, 1.0, 0.0, 64 / 255])
    _assert_same(read_pcd(path), _open3d_read(path))


def test_writer_rejects_wrong_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(N, 4\)"):
        write_pcd(tmp_path / "bad.pcd", np.zeros((5, 3), dtype=np.float32))


def test_empty_cloud_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "empty.pcd"
    write_pcd(path, np.zeros((0, 4), dtype=np.float32))
    assert read_pcd(path).shape == (0, 4)


# --------------------------------------------------------------------------------------------------------------
# Hand-written files: intensity fields, other types, COUNT > 1, organised clouds, tricky numbers
# --------------------------------------------------------------------------------------------------------------


def test_ascii_intensity_field_wins_over_rgb(tmp_path: Path) -> None:
    path = _write_text(tmp_path / "i.pcd", _header("x y z rgb intensity", "4 4 4 4 4", "F F F U F", "1 1 1 1 1", 2),
                       ["1 2 3 16777215 0.25", "-4.5 5e-3 +6 0 0.75"])
    assert read_pcd(path).tolist() == [[1, 2, 3, 0.25], [-4.5, np.float32(5e-3), 6, 0.75]]


def test_binary_intensity_field_with_other_types_and_counts(tmp_path: Path) -> None:
    # x as double, a COUNT 3 field between, intensity as uint8: every layout goes through the structured dtype.
    header = _header("x y pad z intensity", "8 4 2 4 1", "F F I F U", "1 1 3 1 1", 2, "binary")
    record = struct.Struct("<df3hfB")
    rows = [record.pack(1.25, -2.5, 7, 8, 9, 3.5, 200), record.pack(-0.1, 0.2, 0, 0, 0, 1e30, 3)]
    path = tmp_path / "typed.pcd"
    path.write_bytes(("\n".join(header) + "\n").encode() + b"".join(rows))
    ours = read_pcd(path)
    assert ours.tolist() == [[1.25, -2.5, 3.5, 200.0], [np.float32(-0.1), np.float32(0.2), np.float32(1e30), 3.0]]
    assert read_pcd_header(path).point_size == 8 + 4 + 6 + 4 + 1


def test_binary_rgba_with_count_and_extra_fields(tmp_path: Path) -> None:
    header = _header("x y z normal_x rgba", "4 4 4 4 4", "F F F F U", "1 1 1 2 1", 3, "binary")
    rng = np.random.default_rng(3)
    data = np.zeros(3, dtype=[("xyz", "<f4", (3,)), ("n", "<f4", (2,)), ("c", "<u4")])
    data["xyz"] = rng.normal(size=(3, 3))
    data["c"] = [0xFF102030, 0x00FFFFFF, 0x12345678]
    path = tmp_path / "rgba.pcd"
    path.write_bytes(("\n".join(header) + "\n").encode() + data.tobytes())
    ours = read_pcd(path)  # open3d 0.20 itself crashes on COUNT > 1 in binary data, so no cross-check here
    assert np.array_equal(ours[:, :3], data["xyz"])
    assert np.array_equal(ours[:, 3], (np.array([0x10, 0xFF, 0x34]) / 255.0).astype(np.float32))


def test_organised_cloud_uses_width_times_height(tmp_path: Path) -> None:
    lines = _header("x y z", "4 4 4", "F F F", "1 1 1", 4)
    lines = [line for line in lines if not line.startswith(("WIDTH", "HEIGHT", "POINTS"))]
    path = _write_text(tmp_path / "org.pcd", ["WIDTH 2", "HEIGHT 2"] + lines, ["0 0 0", "1 1 1", "2 2 2", "3 3 3"])
    assert read_pcd(path)[:, 0].tolist() == [0, 1, 2, 3]


def test_ascii_numbers_are_parsed_like_strtod(tmp_path: Path) -> None:
    tokens = ["0", "-0", "+1.5", ".5", "5.", "-.25", "1e3", "1E-3", "2.5e+2", "123456789012345", "0.1",
              "9007199254740993", "1.00000000000000011102230246251565404236316680908203125", "1e-320", "1e39",
              "nan", "-inf", "0.000001234567891", "-96.69447327", "3.4028235e38", "1.17549435e-38", "16777217"]
    while len(tokens) % 3:
        tokens.append("7")
    rows = [" ".join(tokens[i:i + 3]) for i in range(0, len(tokens), 3)]
    path = _write_text(tmp_path / "tricky.pcd", _header("x y z", "4 4 4", "F F F", "1 1 1", len(rows)), rows)
    with np.errstate(over="ignore"):  # 1e39 is inf in float32, in open3d's cast as in ours
        expected = np.array([float(token) for token in tokens]).astype(np.float32).reshape(-1, 3)
    ours = read_pcd(path)
    assert np.array_equal(ours[:, :3].view(np.uint32), expected.view(np.uint32))
    _assert_same(ours, _open3d_read(path))


def test_ascii_float_colour_decodes_like_open3d(tmp_path: Path) -> None:
    # Every red byte, packed as the bits of a float (OPV2V) and printed in several precisions.
    red = np.arange(256, dtype=np.uint32)
    packed = ((red << 16) | (red[::-1] << 8) | 7).view(np.float32)
    rows = [f"{i} 0 0 {value:.10g}" for i, value in enumerate(packed.astype(np.float64))]
    rows += [f"{i} 1 0 {value:.9e}" for i, value in enumerate(packed.astype(np.float64))]
    rows += ["0 2 0 1e-45", "0 3 0 0", "0 4 0 -0", "0 5 0 1.5", "0 6 0 -1e-39"]
    path = _write_text(tmp_path / "f.pcd", _header("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", len(rows)), rows)
    ours = read_pcd(path)
    _assert_same(ours, _open3d_read(path))
    assert np.array_equal(ours[:256, 3], (red / 255.0).astype(np.float32))


def test_ascii_integer_colour_decodes_like_open3d(tmp_path: Path) -> None:
    rows = ["0 0 0 8421504", "1 0 0 16777215", "2 0 0 0", "3 0 0 4278190335", "4 0 0 -1"]
    for kind in ("U", "I"):
        path = _write_text(tmp_path / f"{kind}.pcd", _header("x y z rgb", "4 4 4 4", f"F F F {kind}", "1 1 1 1", 5),
                           rows)
        _assert_same(read_pcd(path), _open3d_read(path))


def test_crlf_tabs_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    text = "\r\n".join(_header("x y z", "4 4 4", "F F F", "1 1 1", 3)) + "\r\n1\t2 3\r\n\r\n4 5  6 \r\n7 8 9"
    path = tmp_path / "crlf.pcd"
    path.write_bytes(text.encode())
    assert read_pcd(path)[:, :3].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


# --------------------------------------------------------------------------------------------------------------
# Bad files: one DataError each, naming the file
# --------------------------------------------------------------------------------------------------------------


def _expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(DataError) as caught:
        read_pcd(path)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope.pcd", "not found")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    _expect_error(tmp_path, "cannot read")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pcd"
    path.write_bytes(b"")
    _expect_error(path, "empty")


@pytest.mark.parametrize("content, fragment", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not ASCII"),
    (b"hello world\n", "unknown keyword"),
    (b"VERSION 0.7\nFIELDS x y z\nPOINTS 1\n", "no DATA line"),
    (b"VERSION 0.7\nFIELDS x y z\nSIZE 4 4\nPOINTS 1\nDATA ascii\n1 2 3\n", "SIZE has 2 entries"),
    (b"FIELDS x y z\nPOINTS many\nDATA ascii\n", "POINTS must be"),
    (b"FIELDS x y z\nWIDTH 3\nHEIGHT 1\nPOINTS 2\nDATA ascii\n", "POINTS 2 != WIDTH 3"),
    (b"POINTS 1\nDATA ascii\n1 2 3\n", "no FIELDS"),
], ids=["binary-junk", "unknown-keyword", "no-data", "size-count", "points-text", "points-width", "no-fields"])
def test_garbled_header(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "garbled.pcd"
    path.write_bytes(content)
    _expect_error(path, "garbled PCD header", fragment)


def test_unsupported_data_type(tmp_path: Path) -> None:
    path = _write_text(tmp_path / "d.pcd", _header("x y z", "4 4 4", "F F F", "1 1 1", 1, "binary_lz4"), [])
    _expect_error(path, "unsupported PCD DATA type 'binary_lz4'")


def test_unsupported_field_type(tmp_path: Path) -> None:
    path = _write_text(tmp_path / "t.pcd", _header("x y z", "4 4 3", "F F F", "1 1 1", 1), ["1 2 3"])
    _expect_error(path, "unsupported PCD field 'z'")


def test_missing_xyz_fields(tmp_path: Path) -> None:
    path = _write_text(tmp_path / "xy.pcd", _header("x y intensity", "4 4 4", "F F F", "1 1 1", 1), ["1 2 3"])
    _expect_error(path, "no z field")


def test_truncated_binary(tmp_path: Path) -> None:
    path = tmp_path / "short.pcd"
    write_pcd(path, _cloud(100), binary=True)
    path.write_bytes(path.read_bytes()[:-10])
    _expect_error(path, "truncated binary data", "1590 bytes after the header, 1600 needed")


def test_truncated_compressed(tmp_path: Path) -> None:
    path = tmp_path / "short_lzf.pcd"
    _open3d_write(path, _cloud(1000), ascii_data=False, compressed=True)
    path.write_bytes(path.read_bytes()[:-100])
    _expect_error(path, "compressed")


@pytest.mark.parametrize("rows, fragment", [
    (["1 2 3", "4 5 6"], "has 2 rows but the header says POINTS 3"),
    (["1 2 3", "4 5 6", "7 8 9", "10 11 12"], "has 4 rows but the header says POINTS 3"),
    (["1 2 3", "4 5", "6 7 8 9"], "row 2 has 2 values"),
    (["1 2 3 4", "5 6", "7 8 9"], "row 1 has 4 values"),
], ids=["short", "long", "split-row", "shifted-row"])
def test_ascii_row_count_mismatch(tmp_path: Path, rows: list[str], fragment: str) -> None:
    path = _write_text(tmp_path / "rows.pcd", _header("x y z", "4 4 4", "F F F", "1 1 1", 3), rows)
    _expect_error(path, fragment)


@pytest.mark.parametrize("token", ["1.2.3", "abc", "1e", "--1", "1_000", "0x10", "1,5", "e5", "1-2"])
def test_ascii_value_that_is_not_a_number(tmp_path: Path, token: str) -> None:
    path = _write_text(tmp_path / "nan.pcd", _header("x y z", "4 4 4", "F F F", "1 1 1", 2), ["1 2 3", f"4 {token} 6"])
    _expect_error(path, "row 2 has a value that is not a number")


def test_ascii_float_colour_near_float32_midpoints(tmp_path: Path) -> None:
    # Decimals at and next to the midpoint of two float32s: strtof must round them exactly, not via a double.
    from decimal import Decimal, getcontext

    getcontext().prec = 80
    rows = []
    for bits in (0x00808080, 0x007F7F7F, 0x00FFFFFF, 0x00010101):
        low = Decimal(float(np.uint32(bits).view(np.float32)))
        high = Decimal(float(np.uint32(bits + 1).view(np.float32)))
        middle = (low + high) / 2
        for value in (middle, middle + Decimal("1e-70"), middle - Decimal("1e-70")):
            rows.append(f"0 0 0 {value}")
    path = _write_text(tmp_path / "mid.pcd", _header("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", len(rows)), rows)
    _assert_same(read_pcd(path), _open3d_read(path))


def test_ascii_float_colour_at_float32s_overflow_threshold(tmp_path: Path) -> None:
    # strtof gives FLT_MAX below FLT_MAX + half its last step (2^128 - 2^103) and infinity from there on; a double
    # on the way may already round a decimal just below up to the threshold.
    from decimal import Decimal, getcontext

    getcontext().prec = 80
    threshold = Decimal(2 ** 128 - 2 ** 103)
    values = [Decimal(float(np.finfo(np.float32).max)), Decimal("3.4028235677973366e38"), threshold,
              threshold - Decimal("1e-30"), threshold + Decimal("1e-30")]
    rows = [f"0 0 0 {sign}{value}" for value in values for sign in ("", "-")]
    path = _write_text(tmp_path / "edge.pcd", _header("x y z rgb", "4 4 4 4", "F F F F", "1 1 1 1", len(rows)), rows)
    with np.errstate(over="ignore"):
        bits = [int(np.array([pcd._text_float32(row.split()[3].encode(), 0, "t")]).view(np.uint32)[0]) for row in rows]
    assert bits[:4] == [0x7F7FFFFF, 0xFF7FFFFF] * 2 and bits[4:6] == [0x7F800000, 0xFF800000]  # by hand
    _assert_same(read_pcd(path), _open3d_read(path))


# --------------------------------------------------------------------------------------------------------------
# The compiled parser against exact per-token arithmetic: same bits, errors in the same order
# --------------------------------------------------------------------------------------------------------------


_LIBC = ctypes.CDLL(None)
_LIBC.strtof.restype, _LIBC.strtof.argtypes = ctypes.c_float, [ctypes.c_char_p, ctypes.c_void_p]


def _exact_colour_bits(text: str, colour_type: str) -> int:
    """The 32 bits open3d keeps of a colour token: the C library's own strtof (correctly rounded in glibc, where
    float32(float(text)) rounds twice), or the double truncated to an integer's low 32 bits (non-finite: 0)."""
    if colour_type == "F":
        return struct.unpack("<I", struct.pack("<f", _LIBC.strtof(text.encode(), None)))[0]
    value = float(text)  # strtod: both correctly rounded
    return math.trunc(value) & 0xFFFFFFFF if math.isfinite(value) else 0


def _exact_read(path: Path) -> np.ndarray:
    """What read_pcd must return for an ascii file, computed one token at a time: float() is strtod (correctly
    rounded), the colour's red byte comes from _exact_colour_bits. Slow, and independent of the compiled pass."""
    header = read_pcd_header(path)
    rows = [line.decode().split() for line in path.read_bytes()[header.data_offset:].splitlines() if line.strip()]
    colour = next((field for field in header.fields if field.name in ("rgb", "rgba")), None)
    out = np.zeros((len(rows), 4), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # float32 overflow, integer colours beyond int64
        for number, tokens in enumerate(rows):
            for axis, name in enumerate("xyz"):
                out[number, axis] = np.float32(float(tokens[header.column(name)]))
            if header.field("intensity") is not None:
                out[number, 3] = np.float32(float(tokens[header.column("intensity")]))
            elif colour is not None:
                bits = _exact_colour_bits(tokens[header.column(colour.name)], colour.type)
                out[number, 3] = np.float32(((bits >> 16) & 0xFF) / 255.0)
    return out


def _float32_midpoints(rng: np.random.Generator, count: int) -> list[str]:
    """Decimals at, next to and 19-digit-rounded from midpoints of adjacent float32s (normal and denormal)."""
    getcontext().prec = 120
    bits = np.concatenate([rng.integers(1, 0x00800000, count // 2), rng.integers(0x00800000, 0x7F000000, count // 2)])
    # Only the red byte (bits 16-23) of a colour shows: make most midpoints lie between ...FFFF and the next float.
    bits[: count * 3 // 4] |= 0xFFFF
    bits = np.concatenate([bits, [0, 0x00808080, 0x007F7F7F, 0x00FFFFFF, 0x00010101, 0x7F7FFFFE]]).astype(np.uint32)
    tokens = []
    for b in bits.tolist():
        low = Decimal(float(np.uint32(b).view(np.float32)))
        high = Decimal(float(np.uint32(b + 1).view(np.float32)))
        middle = (low + high) / 2
        tokens += [f"{middle:.18e}", f"{middle:.16e}", f"{middle:.9e}", str(middle)]
        # A few double ulps either side: where a double approximation of the decimal could round the wrong way.
        tokens += [f"{middle * (1 + Decimal(k) * Decimal('1e-18')):.18e}" for k in (-400, -40, -8, -3, 3, 8, 40, 400)]
    return tokens


def _tricky_tokens(rng: np.random.Generator, count: int) -> list[str]:
    """Numbers in many spellings: exponents, 1 to 25 digits, signs, zeros, subnormals, specials, midpoints."""
    tokens = ["0", "-0", "+0", "-0.0", "0e0", "-0e-5", "0e999", "-0.000", "00012.5000", "5.", ".5", "-.25", "+.5e1",
              "1E-3", "1e+3", "1e-320", "4.9e-324", "2.4703282292062327e-324", "1e-310", "1e-45", "1.4e-45",
              "7.006492321624085e-46", "7e-46", "1.17549435e-38", "1.1754943e-38", "3.4028235e38", "3.40282357e38",
              "1e39", "1e308", "1.8e308", "1e400", "-1e400", "9007199254740992", "9007199254740993",
              "18446744073709551615", "99999999999999999999", "1234567890123456789", "12345678901234567890",
              "0.1234567890123456789", "0.12345678901234567890123", "1e22", "1e23", "-1e22", "1e-22", "1e-23",
              "123456789e-30", "nan", "-nan", "inf", "-inf", "Infinity", "NaN", "4278190335", "-1", "16777215",
              "2147483648", "-2147483649", "9223372036854775807", "9.3e18", "-9.3e18", "3.7", "-2.5", "1e10"]
    tokens += _float32_midpoints(rng, 40)
    any_float32 = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):  # NaN payloads
        values = np.concatenate([
            rng.uniform(-200, 200, count), rng.normal(size=count) * 10.0 ** rng.integers(-45, 39, count),
            any_float32.astype(np.float64), rng.integers(-10**6, 10**6, count).astype(np.float64),
        ])
    formats = ["%.1g", "%.6g", "%.9g", "%.10g", "%.15g", "%.17g", "%.19g", "%.20g", "%.21g", "%.3e", "%.9e",
               "%.16e", "%.18e", "%.19e", "%.24e", "%.0f", "%.3f", "%.8f", "%r", "%+.7G"]
    for value, form in zip(values.tolist(), rng.choice(formats, len(values)).tolist()):
        tokens.append(repr(value) if form == "%r" else form % value)
    return tokens


@pytest.mark.parametrize("layout", ["rgb F", "rgb U", "rgb I", "intensity", "rgba F last", "no colour"])
def test_tricky_numbers_read_as_exact_arithmetic_does(tmp_path: Path, layout: str) -> None:
    rng = np.random.default_rng(7)
    tokens = _tricky_tokens(rng, 3000)
    rng.shuffle(tokens)
    fields = {"rgb F": ("x y z rgb", "F F F F"), "rgb U": ("x y z rgb", "F F F U"),
              "rgb I": ("x y z rgb", "F F F I"), "intensity": ("x y z intensity", "F F F F"),
              "rgba F last": ("y normal z x rgba", "F F F F F"), "no colour": ("x y z", "F F F")}[layout]
    per_row = len(fields[0].split())
    while len(tokens) % per_row:
        tokens.append("1")
    rows = [" ".join(tokens[i:i + per_row]) for i in range(0, len(tokens), per_row)]
    count = len(rows)
    header = _header(fields[0], " ".join(["4"] * per_row), fields[1], " ".join(["1"] * per_row), count)
    path = _write_text(tmp_path / "tricky.pcd", header, rows)
    with np.errstate(over="ignore", invalid="ignore"):
        ours = read_pcd(path)
    assert ours.shape == (count, 4)
    _assert_same(ours, _exact_read(path))
    if layout in ("rgb F", "rgba F last", "no colour"):
        # open3d reads these layouts as we do (it drops an intensity field, and reads integer colours as a prefix
        # of the token: test_integer_colours_* below).
        _assert_same(ours, _open3d_read(path))


@pytest.mark.parametrize("colour_type", ["U", "I"])
def test_integer_colours_written_as_integers_read_as_open3d_does(tmp_path: Path, colour_type: str) -> None:
    """The form a tool writes into a TYPE U or I field (PCL's packed rgba): plain integers, negative ones and ones
    past 32 bits included, read bit for bit as open3d's strtoul / strtol do."""
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.integers(0, 2**32, 2000), rng.integers(-2**31, 2**31, 2000),
                             rng.integers(-2**62, 2**62, 500), [0, 2**32 - 1, 2**31, -2**31, 0xFF0000, 0x00FFFF]])
    rows = [f"{i % 7}.5 -{i % 5} {i} {value}" for i, value in enumerate(values.tolist())]
    path = _write_text(tmp_path / "packed.pcd", _header("x y z rgb", "4 4 4 4", f"F F F {colour_type}", "1 1 1 1",
                                                        len(rows)), rows)
    ours = read_pcd(path)
    _assert_same(ours, _open3d_read(path))
    assert len(np.unique(ours[:, 3])) > 200  # the red bytes vary: the check reads them


def test_integer_colours_in_other_forms_are_their_values_where_open3d_reads_a_prefix(tmp_path: Path) -> None:
    """docs/compatibility.md, "PCD files": open3d's strtoul stops at an 'e' and reads a leading 0 as octal; we
    read the number. If open3d starts reading these as numbers, the row can go."""
    tokens = ["1e5", "0400000", "1.9e6"]  # red bytes of 100000, 400000 and 1900000: 1, 6, 28
    path = _write_text(tmp_path / "forms.pcd", _header("x y z rgb", "4 4 4 4", "F F F U", "1 1 1 1", len(tokens)),
                       [f"0 0 0 {token}" for token in tokens])
    assert (read_pcd(path)[:, 3] * 255).round().tolist() == [1, 6, 28]
    assert (_open3d_read(path)[:, 3] * 255).round().tolist() == [0, 2, 0]  # 1, octal 0400000 = 131072, 1


@pytest.mark.parametrize("writer", ["open3d", "ours"])
def test_written_clouds_read_as_exact_arithmetic_and_open3d_do(tmp_path: Path, writer: str) -> None:
    cloud = _cloud(30_000, seed=5)
    cloud[3, 2] = -0.0
    cloud[4, 0] = np.float32(1e-44)  # a float32 subnormal
    path = tmp_path / "cloud.pcd"
    if writer == "open3d":
        _open3d_write(path, cloud, ascii_data=True)
    else:
        write_pcd(path, cloud)
    ours = read_pcd(path)
    _assert_same(ours, _exact_read(path))
    _assert_same(ours, _open3d_read(path))


_SAME_ROWS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]


@pytest.mark.parametrize("rows, expected", [
    (["1 2 3", "4 abc 6", "7 8 1.2.3"], "row 2 has a value that is not a number (b'abc')"),
    (["1 2 3", "4 5 6 7", "8 9"], "row 2 has 4 values, the header's FIELDS/COUNT need 3"),
    (["1 2 3 4 5 6", "7 8 9"], "row 1 has 6 values, the header's FIELDS/COUNT need 3"),
    (["1 2 3", "4 5 6"], "has 2 rows but the header says POINTS 3: the file is truncated"),
    (["1 2 3", "4 5"], "ends inside row 2 of the header's POINTS 3: the file is truncated"),
    (["1 2 3", "4 5 6", "7 8 9", "1"], "row 4 has 1 values, the header's FIELDS/COUNT need 3"),
    (["1\t2 3", "4 5 6\r", "7 8 9"], _SAME_ROWS),
    (["1 2 3\r4 5 6", "7 8 9"], _SAME_ROWS),  # a bare CR ends a row too (open3d misreads this file)
    (["zz 2 3", "4 1_0 6", "7 8 9"], "row 1 has a value that is not a number (b'zz')"),
    (["1 2 0x10", "inf -nan 1e400", "7 8 9"], "row 1 has a value that is not a number (b'0x10')"),
], ids=["two-bad", "split", "joined", "short", "cut-in-row", "long", "tab-cr", "bare-cr", "junk-order", "specials"])
def test_ascii_layouts_and_errors(tmp_path: Path, rows: list[str], expected: str | list) -> None:
    path = _write_text(tmp_path / "rows.pcd", _header("x y z", "4 4 4", "F F F", "1 1 1", 3), rows)
    if isinstance(expected, str):
        _expect_error(path, expected)
    else:
        assert read_pcd(path)[:, :3].tolist() == expected


def test_a_bad_coordinate_is_reported_before_a_bad_colour(tmp_path: Path) -> None:
    # The colour of row 1 and z, x of row 2 are bad: coordinates are read before colours, x before z, so row 2's
    # x is named although z comes first in the file.
    path = _write_text(tmp_path / "bad.pcd", _header("z y x rgb", "4 4 4 4", "F F F F", "1 1 1 1", 2),
                       ["1 2 3 oops", "bad 5 worse 7"])
    _expect_error(path, "row 2", "worse")


def test_numba_parser_flags_what_it_cannot_prove_exact() -> None:
    from opencood_ddp.data import _ascii_numba as parser

    getcontext().prec = 80
    low = Decimal(float(np.uint32(0x00808080).view(np.float32)))
    high = Decimal(float(np.uint32(0x00808081).view(np.float32)))
    near_tie = f"{(low + high) / 2:.18e}"  # 19 digits, closer to the float32 midpoint than the double's error
    rows = [("1.5", "2", "3", "1e-38"), ("nan", "1e23", "12345678901234567890", near_tie),
            ("-0", "1.25e-3", "inf", "2.35098856e-38"), ("0x1p3", "9007199254740993", "7", "1e400"),
            ("1", "2", "3", "3.4028235e38")]
    body = ("\n".join(" ".join(row) for row in rows) + "\n").encode()
    out = np.full((5, 4), -7.0, dtype=np.float32)
    modes = np.array([parser.DOUBLE, parser.DOUBLE, parser.DOUBLE, parser.FLOAT32_BITS], dtype=np.int64)
    status, flagged = parser.parse_body(np.frombuffer(body, dtype=np.uint8), 5, 4, np.arange(4, dtype=np.int64),
                                        modes, out)
    assert status == parser.STATUS_OK
    assert sorted((row, column) for row, column, _, _ in flagged.tolist()) == [
        (1, 0), (1, 1), (1, 2), (1, 3), (2, 2), (3, 0), (3, 1), (3, 3), (4, 3)]
    for row, column, start, end in flagged.tolist():
        assert body[start:end] == rows[row][column].encode()
    red = (int(np.float32(1e-38).view(np.uint32)) >> 16) & 0xFF
    assert out[0].tolist() == [1.5, 2.0, 3.0, np.float32(red / 255.0)]  # the red byte of strtof("1e-38")
    assert out[2, :2].tolist() == [0.0, np.float32(1.25e-3)] and np.signbit(out[2, 0])
    assert out[3, 2] == 7.0
    # A layout the compiled parser does not accept is only reported: pcd.py explains it.
    status, _ = parser.parse_body(np.frombuffer(b"1 2 3 4\n5 6 7", dtype=np.uint8), 2, 4,
                                  np.arange(4, dtype=np.int64), modes, out)
    assert status == parser.STATUS_LAYOUT


def test_numba_parser_works_without_a_writable_cache(tmp_path: Path) -> None:
    path = tmp_path / "cloud.pcd"
    write_pcd(path, _cloud(200, seed=4))
    script = (
        "import warnings, numpy as np\n"
        "import numba.core.caching as caching\n"
        "def refuse(self):\n"
        "    raise OSError('read-only')\n"
        "caching._CacheLocator.ensure_cache_path = refuse  # no locator can write: numba cannot cache at all\n"
        "from opencood_ddp.data import pcd\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    ours = pcd.read_pcd({str(path)!r})  # the first ascii read compiles the parser\n"
        "assert any('NUMBA_CACHE_DIR' in str(w.message) for w in caught), [str(w.message) for w in caught]\n"
        f"np.save({str(tmp_path / 'ours.npy')!r}, ours)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    _assert_same(np.load(tmp_path / "ours.npy"), _open3d_read(path))
