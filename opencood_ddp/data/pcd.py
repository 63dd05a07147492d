"""Read and write .pcd point clouds the way OPV2V stores them, without open3d on the hot path.

OPV2V frames are .pcd files written by open3d (``write_point_cloud`` with ``colors = [i, i, i]``): fields
``x y z rgb``, the LiDAR intensity stored in the red byte of a packed ``rgb`` value. ``read_pcd`` returns an
(N, 4) float32 array ``x, y, z, intensity`` that is bit-for-bit what open3d's reader gives
(``np.asarray(pcd.points)`` and ``np.asarray(pcd.colors)[:, 0]``, both cast to float32):

- x, y, z: open3d parses ascii numbers with ``strtod`` (to double) and binary numbers at their stored width; we do the
  same and cast the double to float32 once.
- intensity: a field named ``intensity`` wins when present; otherwise the red channel of ``rgb`` (or ``rgba``):
  open3d takes the 4 stored bytes of the field (little-endian B, G, R, A), so red = ``(bits >> 16) & 0xFF`` whatever
  the TYPE (``F``: the bits of the float32, ascii parsed with ``strtof``; ``U``/``I``: the integer's bits), and
  colour = red / 255.0 in double. A field of another size gives colour 0, as in open3d. No intensity and no rgb: 0.
  An ascii ``U``/``I`` colour is the low 32 bits of the token's value truncated to an integer (non-finite: 0).
  open3d parses it with ``strtoul``/``strtol`` (base 0), which stop at a '.' or an 'e' and read a leading 0 as
  octal: the same bits for an integer written as one (what PCL and open3d write), other bits for ``1e5``,
  ``0123`` or a value beyond 64 bits (docs/compatibility.md, "PCD files").
- Non-finite points are kept: open3d's ``read_point_cloud`` defaults to ``remove_nan_points=False`` and
  ``remove_infinite_points=False`` (checked against open3d 0.20), so N is always the header's POINTS.

We are stricter than open3d where it would silently return garbage: a short or long ascii body, a truncated
binary body, an unknown header line or a malformed number raise ``DataError`` naming the file, what is wrong and the
fix, where open3d logs a warning and returns an empty or zero-filled cloud.

``write_pcd`` writes what OPV2V's dumper wrote (open3d of that era): the same 11 header lines, ``TYPE F F F F``
with the colour packed as the bits of a float32, ascii numbers printed ``%.10g``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction
from typing import Union

import numpy as np

from opencood_ddp.errors import DataError

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["PcdField", "PcdHeader", "RED_TO_INTENSITY", "colour_intensity", "read_pcd", "read_pcd_header",
           "read_pcd_records", "write_pcd"]

# A PCD header is a dozen short lines; anything longer without a DATA line is not a PCD file.
_MAX_HEADER_BYTES = 1 << 16
_HEADER_KEYS = frozenset(
    ("VERSION", "FIELDS", "COLUMNS", "SIZE", "TYPE", "COUNT", "WIDTH", "HEIGHT", "VIEWPOINT", "POINTS", "DATA")
)
_DATA_TYPES = ("ascii", "binary", "binary_compressed")
_NUMPY_KINDS = {"F": "f", "I": "i", "U": "u"}
_VALID_SIZES = {"F": (4, 8), "I": (1, 2, 4, 8), "U": (1, 2, 4, 8)}

# open3d turns the red byte into a double r / 255.0; the table holds that double cast to float32.
RED_TO_INTENSITY = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)

# ---------------------------------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PcdField:
    """One FIELDS entry: name, byte size of one value, type letter (F, I, U), values per point, byte offset."""

    name: str
    size: int
    type: str
    count: int
    offset: int


@dataclasses.dataclass(frozen=True)
class PcdHeader:
    """The parsed header; ``data_offset`` is where the point data starts in the file."""

    fields: tuple[PcdField, ...]
    width: int
    height: int
    points: int
    data: str
    data_offset: int

    @property
    def point_size(self) -> int:
        """Bytes per point in binary data."""
        return sum(field.size * field.count for field in self.fields)

    @property
    def values_per_point(self) -> int:
        """Numbers per row in ascii data."""
        return sum(field.count for field in self.fields)

    def field(self, name: str) -> PcdField | None:
        """The first field called ``name``, or None."""
        return next((field for field in self.fields if field.name == name), None)

    def column(self, name: str) -> int:
        """Index of the first value of field ``name`` within an ascii row."""
        index = 0
        for field in self.fields:
            if field.name == name:
                return index
            index += field.count
        raise KeyError(name)


def _garbled(path: PathLike, detail: str) -> DataError:
    return DataError(f"{path}: garbled PCD header ({detail}); re-export the file with open3d or PCL")


def _split_header_lines(raw: bytes, path: PathLike) -> tuple[dict[str, list[str]], int]:
    """Header entries by key (the last one wins) and the offset of the first data byte."""
    entries: dict[str, list[str]] = {}
    pos = 0
    line_number = 0
    while pos < len(raw) and pos <= _MAX_HEADER_BYTES:
        newline = raw.find(b"\n", pos)
        end = len(raw) if newline < 0 else newline
        line, pos = raw[pos:end], end + 1
        line_number += 1
        try:
            words = line.decode("ascii").split()
        except UnicodeDecodeError:
            raise _garbled(path, f"line {line_number} is not ASCII text") from None
        if not words or words[0].startswith("#"):
            continue
        key = words[0]
        if key not in _HEADER_KEYS:
            raise _garbled(path, f"line {line_number} starts with unknown keyword {key[:20]!r}")
        entries[key] = words[1:]
        if key == "DATA":
            return entries, min(pos, len(raw))
    raise _garbled(path, "no DATA line")


def _int_entry(entries: dict[str, list[str]], key: str, path: PathLike) -> int | None:
    values = entries.get(key)
    if values is None:
        return None
    if len(values) != 1 or not values[0].isdigit():
        raise _garbled(path, f"{key} must be one non-negative integer, got {' '.join(values)!r}")
    return int(values[0])


def _per_field(entries: dict[str, list[str]], key: str, default: str, n_fields: int, path: PathLike) -> list[str]:
    values = entries.get(key, [default] * n_fields)
    if len(values) != n_fields:
        raise _garbled(path, f"{key} has {len(values)} entries for {n_fields} FIELDS")
    return values


def _parse_fields(entries: dict[str, list[str]], path: PathLike) -> tuple[PcdField, ...]:
    names = entries.get("FIELDS", entries.get("COLUMNS"))
    if not names:
        raise _garbled(path, "no FIELDS line")
    sizes = _per_field(entries, "SIZE", "4", len(names), path)
    types = _per_field(entries, "TYPE", "F", len(names), path)
    counts = _per_field(entries, "COUNT", "1", len(names), path)
    fields = []
    offset = 0
    for name, size_text, type_letter, count_text in zip(names, sizes, types, counts):
        if not (size_text.isdigit() and count_text.isdigit()):
            raise _garbled(path, f"SIZE {size_text!r} / COUNT {count_text!r} of field {name!r} are not integers")
        size, count = int(size_text), int(count_text)
        if type_letter not in _VALID_SIZES or size not in _VALID_SIZES[type_letter] or count < 1:
            raise DataError(
                f"{path}: unsupported PCD field {name!r} (TYPE {type_letter}, SIZE {size}, COUNT {count}); "
                "re-save it with TYPE F/I/U, SIZE 1/2/4/8 and COUNT >= 1"
            )
        fields.append(PcdField(name, size, type_letter, count, offset))
        offset += size * count
    return tuple(fields)


def _point_count(entries: dict[str, list[str]], path: PathLike) -> tuple[int, int, int]:
    """(width, height, points); POINTS and WIDTH x HEIGHT must agree when both are given."""
    width = _int_entry(entries, "WIDTH", path)
    height = _int_entry(entries, "HEIGHT", path)
    points = _int_entry(entries, "POINTS", path)
    if width is not None and height is None:
        height = 1
    if points is None:
        if width is None:
            raise _garbled(path, "neither POINTS nor WIDTH given")
        points = width * height
    if width is None:
        width, height = points, 1
    if width * height != points:
        raise _garbled(path, f"POINTS {points} != WIDTH {width} x HEIGHT {height}")
    return width, height, points


def _parse_header(raw: bytes, path: PathLike) -> PcdHeader:
    if not raw:
        raise DataError(f"{path}: file is empty; re-export or re-download this frame")
    entries, data_offset = _split_header_lines(raw, path)
    fields = _parse_fields(entries, path)
    width, height, points = _point_count(entries, path)
    data = entries["DATA"][0] if entries["DATA"] else ""
    if data not in _DATA_TYPES:
        raise DataError(f"{path}: unsupported PCD DATA type {data[:30]!r}; re-save it as ascii, binary or "
                        "binary_compressed")
    names = {field.name for field in fields}
    missing = [axis for axis in ("x", "y", "z") if axis not in names]
    if missing:
        raise DataError(f"{path}: PCD has no {'/'.join(missing)} field (FIELDS {' '.join(f.name for f in fields)}); "
                        "a point cloud needs x, y and z: re-export it with coordinates")
    return PcdHeader(fields, width, height, points, data, data_offset)


def _read_bytes(path: PathLike) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise DataError(f"{path}: point cloud file not found; check the dataset root and split folder") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read point cloud ({error.strerror}); check the path and its permissions") \
            from None


def read_pcd_header(path: PathLike) -> PcdHeader:
    """Parse the header of ``path`` (reads the whole file; headers are not indexed separately)."""
    return _parse_header(_read_bytes(path), path)


# ---------------------------------------------------------------------------------------------------------------
# Binary data
# ---------------------------------------------------------------------------------------------------------------


def _structured_dtype(header: PcdHeader) -> np.dtype:
    """One record per point; field i is named f{i} because PCD allows repeated names (PCL's '_' padding)."""
    formats = []
    for field in header.fields:
        base = np.dtype(f"<{_NUMPY_KINDS[field.type]}{field.size}")
        formats.append(base if field.count == 1 else (base, (field.count,)))
    return np.dtype({
        "names": [f"f{i}" for i in range(len(header.fields))],
        "formats": formats,
        "offsets": [field.offset for field in header.fields],
        "itemsize": header.point_size,
    })


def _as_double_then_float32(values: np.ndarray) -> np.ndarray:
    """open3d widens every value to double before we narrow to float32; wide integers must take the same route."""
    if values.dtype.kind in "iu" and values.dtype.itemsize >= 4:
        return values.astype(np.float64)
    return values


def _binary_records(raw: bytes, header: PcdHeader, path: PathLike) -> np.ndarray:
    needed = header.points * header.point_size
    available = len(raw) - header.data_offset
    if available < needed:
        raise DataError(
            f"{path}: truncated binary data ({available} bytes after the header, {needed} needed for "
            f"{header.points} points of {header.point_size} bytes); re-download or re-export the file"
        )
    # Bytes past the last point are ignored, as open3d does.
    return np.frombuffer(raw, dtype=_structured_dtype(header), count=header.points, offset=header.data_offset)


def _record_column(records: np.ndarray, header: PcdHeader, name: str) -> np.ndarray:
    """First value of field ``name`` for every point (open3d reads element 0 of a COUNT > 1 field)."""
    field = header.field(name)
    assert field is not None
    values = records[f"f{header.fields.index(field)}"]
    return values if field.count == 1 else values[:, 0]


def _binary_red(raw: bytes, header: PcdHeader, field: PcdField) -> np.ndarray:
    """The red byte of a packed colour: byte 2 of the field's little-endian B, G, R, A bytes."""
    if field.size != 4:
        return np.zeros(header.points, dtype=np.uint8)
    table = np.frombuffer(raw, dtype=np.uint8, count=header.points * header.point_size, offset=header.data_offset)
    return table.reshape(header.points, header.point_size)[:, field.offset + 2]


def _xyz_float_block(raw: bytes, header: PcdHeader) -> np.ndarray | None:
    """The usual layout (x, y, z adjacent float32s, 4-byte aligned records) as one (N, 3) view: one copy, not three."""
    x = header.field("x")
    fields = [x, header.field("y"), header.field("z")]
    if x is None or header.point_size % 4 or x.offset % 4:
        return None
    expected = [(x.offset + 4 * i, "F", 4, 1) for i in range(3)]
    if [(f.offset, f.type, f.size, f.count) for f in fields if f is not None] != expected:
        return None
    table = np.frombuffer(raw, dtype="<f4", count=header.points * header.point_size // 4, offset=header.data_offset)
    start = x.offset // 4
    return table.reshape(header.points, header.point_size // 4)[:, start:start + 3]


def _four_float_records(raw: bytes, header: PcdHeader) -> np.ndarray | None:
    """OPV2V's binary layout (x, y, z float32 then one 4-byte field, 16-byte records) as an (N, 4) float32 view.

    One contiguous copy of it is ~4x cheaper than copying the strided xyz columns.
    """
    if header.point_size != 16 or _xyz_float_block(raw, header) is None or header.field("x").offset != 0:
        return None
    return np.frombuffer(raw, dtype="<f4", count=header.points * 4, offset=header.data_offset).reshape(-1, 4)


def _xyz_columns(raw: bytes, header: PcdHeader, records: np.ndarray) -> np.ndarray:
    """(N, 4) float32 with x, y, z filled in (column 3 is the caller's), by the cheapest copy the layout allows."""
    record_block = _four_float_records(raw, header)
    if record_block is not None:
        return record_block.copy()
    out = np.empty((header.points, 4), dtype=np.float32)
    block = _xyz_float_block(raw, header)
    if block is not None:
        out[:, :3] = block
        return out
    for axis, name in enumerate(("x", "y", "z")):
        out[:, axis] = _as_double_then_float32(_record_column(records, header, name))
    return out


def _read_binary(raw: bytes, header: PcdHeader, path: PathLike) -> np.ndarray:
    records = _binary_records(raw, header, path)
    out = _xyz_columns(raw, header, records)
    colour = _colour_field(header)
    if header.field("intensity") is not None:
        out[:, 3] = _as_double_then_float32(_record_column(records, header, "intensity"))
    elif colour is not None:
        out[:, 3] = RED_TO_INTENSITY[_binary_red(raw, header, colour)]
    else:
        out[:, 3] = 0.0
    return out


def _colour_field(header: PcdHeader) -> PcdField | None:
    """open3d's colour field: the first of the fields named rgb or rgba, in file order."""
    return next((field for field in header.fields if field.name in ("rgb", "rgba")), None)


# ---------------------------------------------------------------------------------------------------------------
# ASCII data
# ---------------------------------------------------------------------------------------------------------------
#
# np.fromstring / np.loadtxt / float() all take longer than open3d itself on a 100k-point cloud, so the body is parsed
# in one numba-compiled pass (``_ascii_numba``, about 5x faster than open3d). That pass computes only what it can
# prove equal to strtod / strtof and flags every other token (nan, inf, junk, long mantissas, float32 near-ties);
# the exact Python code below computes those. A body whose token count or row layout is wrong is explained by
# ``_row_count_error``.


def _text_double(text: bytes, row: int, path: PathLike) -> float:
    """strtod of one token of ascii data row ``row`` (1-based, for the error message)."""
    try:
        if b"_" in text:  # Python accepts 1_000, strtod does not
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise DataError(
            f"{path}: ascii data row {row} has a value that is not a number "
            f"({text[:30]!r}); fix or re-export the file"
        ) from None


_FLOAT32_OVERFLOW = Fraction(2 ** 128 - 2 ** 103)  # the decimals strtof rounds to infinity: from here on


def _nearest_float32(text: bytes) -> np.float32:
    """strtof: the float32 nearest to the exact decimal, ties to even."""
    exact = Fraction(text.decode("ascii"))
    guess = np.float32(float(exact))
    if not np.isfinite(guess):
        # The double may round up to float32's overflow threshold (FLT_MAX plus half its last step) while the
        # decimal lies below it, where strtof gives FLT_MAX: only from the threshold on (a tie rounds to the even
        # neighbour, infinity) is the answer infinite.
        if abs(exact) < _FLOAT32_OVERFLOW:
            return np.float32(np.copysign(np.finfo(np.float32).max, float(exact)))
        return guess
    neighbour = np.nextafter(guess, np.float32(np.inf) if Fraction(float(guess)) < exact else np.float32(-np.inf))
    gap_guess = abs(exact - Fraction(float(guess)))
    gap_neighbour = abs(exact - Fraction(float(neighbour)))
    if gap_neighbour < gap_guess or (gap_neighbour == gap_guess and int(neighbour.view(np.uint32)) % 2 == 0):
        return neighbour
    return guess


def _text_float32(text: bytes, row: int, path: PathLike) -> np.float32:
    """strtof of one token of ascii data row ``row`` (1-based, for the error message)."""
    try:
        return _nearest_float32(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        # nan, inf and friends, and decimals beyond any double (1e400): Python's float() spells them as strtof does.
        return np.float32(_text_double(text, row, path))


def _integer_bits(value: float) -> int:
    """The low 32 bits of ``value`` truncated to an integer, exact at any size (non-finite: 0). numpy's cast to
    int64 is not: beyond its range x86 gives INT64_MIN and ARM saturates, so the red byte depended on the CPU."""
    return math.trunc(value) & 0xFFFFFFFF if math.isfinite(value) else 0


def _row_count_error(body: bytes, header: PcdHeader, path: PathLike) -> DataError:
    """Explain why the ascii body is not POINTS rows of the header's values."""
    per_row = header.values_per_point
    counts = [len(row.split()) for row in body.splitlines() if row.strip()]
    for number, count in enumerate(counts, start=1):
        if count != per_row:
            if number == len(counts) < header.points and count < per_row:  # cut off inside its last row
                return DataError(
                    f"{path}: ascii data ends inside row {number} of the header's POINTS {header.points}: the file "
                    "is truncated; re-download or re-export it"
                )
            return DataError(
                f"{path}: ascii data row {number} has {count} values, the header's FIELDS/COUNT need {per_row}; "
                "fix the row or re-export the file"
            )
    if len(counts) < header.points:
        return DataError(
            f"{path}: ascii data has {len(counts)} rows but the header says POINTS {header.points}: the file is "
            "truncated; re-download or re-export it (or fix POINTS/WIDTH if the header is wrong)"
        )
    return DataError(
        f"{path}: ascii data has {len(counts)} rows but the header says POINTS {header.points}; "
        "fix POINTS/WIDTH or re-export the file"
    )


def _read_ascii(raw: bytes, header: PcdHeader, path: PathLike) -> np.ndarray:
    # Imported on first use: numba takes a quarter of a second to import, and binary files never need it.
    from opencood_ddp.data import _ascii_numba as parser  # noqa: PLC0415

    per_row = header.values_per_point
    out_cols = np.full(per_row, -1, dtype=np.int64)
    modes = np.full(per_row, parser.SKIP, dtype=np.int64)
    for axis, name in enumerate("xyz"):
        out_cols[header.column(name)], modes[header.column(name)] = axis, parser.DOUBLE
    colour = _colour_field(header)
    out = np.empty((header.points, 4), dtype=np.float32)
    if header.field("intensity") is not None:
        out_cols[header.column("intensity")], modes[header.column("intensity")] = 3, parser.DOUBLE
    elif colour is not None and colour.size == 4:
        mode = parser.FLOAT32_BITS if colour.type == "F" else parser.INTEGER_BITS
        out_cols[header.column(colour.name)], modes[header.column(colour.name)] = 3, mode
    else:
        out[:, 3] = 0.0
    body = np.frombuffer(raw, dtype=np.uint8, offset=header.data_offset)
    status, flagged = parser.parse_body(body, header.points, per_row, out_cols, modes, out)
    if status != parser.STATUS_OK:
        raise _row_count_error(raw[header.data_offset:], header, path)
    if len(flagged):
        _fill_flagged(raw, header, path, out, flagged, colour)
    return out


def _fill_flagged(raw: bytes, header: PcdHeader, path: PathLike, out: np.ndarray, flagged: np.ndarray,
                  colour: PcdField | None) -> None:
    """Compute the tokens the compiled parser left to exact Python code."""
    # x, y, z of every row before the fourth column, each row by row: of several bad tokens, the error names the
    # first bad coordinate, whatever column order the file has.
    order = np.lexsort((flagged[:, 1], flagged[:, 0], flagged[:, 1] == 3))
    float_colour = header.field("intensity") is None and colour is not None and colour.type == "F"
    for row, column, start, end in flagged[order].tolist():
        text = raw[header.data_offset + start:header.data_offset + end]
        if column < 3 or header.field("intensity") is not None:
            out[row, column] = _text_double(text, row + 1, path)
        elif float_colour:
            bits = np.array([_text_float32(text, row + 1, path)], dtype=np.float32).view(np.uint32)
            out[row, 3] = RED_TO_INTENSITY[(bits[0] >> np.uint32(16)) & np.uint32(0xFF)]
        else:
            bits = _integer_bits(_text_double(text, row + 1, path))
            out[row, 3] = RED_TO_INTENSITY[(bits >> 16) & 0xFF]


# ---------------------------------------------------------------------------------------------------------------
# binary_compressed (LZF): delegated to open3d
# ---------------------------------------------------------------------------------------------------------------


def _read_compressed(header: PcdHeader, path: PathLike) -> np.ndarray:
    try:
        import open3d  # noqa: PLC0415 - optional, heavy, and only needed for this rare encoding
    except ImportError:
        raise DataError(f"{path}: DATA binary_compressed needs open3d to decode; pip install open3d or re-save "
                        "the file as DATA binary") from None
    cloud = open3d.io.read_point_cloud(os.fspath(path), format="pcd")
    xyz = np.asarray(cloud.points)
    if len(xyz) != header.points:
        raise DataError(f"{path}: open3d decoded {len(xyz)} of the {header.points} compressed points (corrupt or "
                        "truncated LZF data); re-download or re-export the file")
    out = np.empty((header.points, 4), dtype=np.float32)
    out[:, :3] = xyz
    if header.field("intensity") is not None:
        # The legacy reader drops unknown fields; the tensor reader keeps intensity.
        tensor_cloud = open3d.t.io.read_point_cloud(os.fspath(path), format="pcd")
        out[:, 3] = tensor_cloud.point["intensity"].numpy().reshape(header.points, -1)[:, 0]
    elif cloud.has_colors():
        out[:, 3] = np.asarray(cloud.colors)[:, 0]
    else:
        out[:, 3] = 0.0
    return out


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


def read_pcd(path: PathLike) -> np.ndarray:
    """Read a .pcd file as an (N, 4) float32 array of x, y, z, intensity (see the module docstring).

    Supports DATA ascii and binary natively and binary_compressed through open3d. NaN and infinite points are
    kept, as open3d's ``read_point_cloud`` keeps them by default. Raises ``DataError`` for a missing, empty,
    garbled, truncated or inconsistent file, naming the file and the fix.
    """
    raw = _read_bytes(path)
    return _decoded(raw, _parse_header(raw, path), path)


def _decoded(raw: bytes, header: PcdHeader, path: PathLike) -> np.ndarray:
    """The (N, 4) cloud of a file's bytes, by its DATA type."""
    # A double beyond float32's range becomes inf, as in open3d's points cast to float32: no warning for that.
    with np.errstate(over="ignore"):
        if header.data == "ascii":
            return _read_ascii(raw, header, path)
        if header.data == "binary":
            return _read_binary(raw, header, path)
        return _read_compressed(header, path)


def read_pcd_records(path: PathLike) -> tuple[np.ndarray, bool]:
    """The cloud as the file stores it where that is already (N, 4) rows of 4-byte values: OPV2V's binary records
    (x, y, z float32, then the packed colour), as a read-only (N, 4) float32 view of the file's bytes whose column 3
    holds the colour's bits, and True; any other file as ``read_pcd`` gives it, and False.

    ``colour_intensity`` turns such a column into ``read_pcd``'s intensity. This spares a DataLoader worker the
    conversion when the device does it (``preprocess.on_device``, data/device_points.py)."""
    raw = _read_bytes(path)
    header = _parse_header(raw, path)
    colour = _colour_field(header)
    if header.data == "binary" and header.field("intensity") is None and colour is not None \
            and (colour.offset, colour.size, colour.count) == (12, 4, 1):
        _binary_records(raw, header, path)  # the truncation check, before a view that needs every byte
        records = _four_float_records(raw, header)
        if records is not None:
            return records, True
    return _decoded(raw, header, path), False


def colour_intensity(bits: np.ndarray) -> np.ndarray:
    """The intensity ``read_pcd`` gives for packed colours of these uint32 bits: the red byte / 255 as float32."""
    return RED_TO_INTENSITY[(np.asarray(bits, dtype=np.uint32) >> np.uint32(16)) & np.uint32(0xFF)]


def _red_byte(intensity: np.ndarray) -> np.ndarray:
    """open3d's colour to byte: round(clamp(c, 0, 1) * 255), halves away from zero, NaN to 0."""
    scaled = np.clip(np.nan_to_num(intensity.astype(np.float64), nan=0.0), 0.0, 1.0) * 255.0
    floor = np.floor(scaled)
    # floor + (fraction >= 0.5) is exact, unlike floor(x + 0.5), which rounds 0.49999999999999994 up.
    return (floor + (scaled - floor >= 0.5)).astype(np.uint32)


def _header_text(points: int, data: str) -> bytes:
    lines = (
        "# .PCD v0.7 - Point Cloud Data file format",
        "VERSION 0.7",
        "FIELDS x y z rgb",
        "SIZE 4 4 4 4",
        "TYPE F F F F",
        "COUNT 1 1 1 1",
        f"WIDTH {points}",
        "HEIGHT 1",
        "VIEWPOINT 0 0 0 1 0 0 0",
        f"POINTS {points}",
        f"DATA {data}",
    )
    return ("\n".join(lines) + "\n").encode("ascii")


def write_pcd(path: PathLike, points: np.ndarray, binary: bool = False) -> None:
    """Write (N, 4) x, y, z, intensity (0..1) as OPV2V's dumper did: open3d with colours [i, i, i].

    Coordinates are stored as float32 (printed ``%.10g`` in ascii, enough to read back the same float32); the
    intensity becomes the byte round(i * 255) in r, g and b of a packed colour stored as the bits of a float32
    (``TYPE F``), the way open3d wrote it then; open3d of any version reads it back as colours i' = byte / 255.
    """
    array = np.asarray(points)
    if array.ndim != 2 or array.shape[1] != 4:
        raise ValueError(f"write_pcd expects an (N, 4) array of x, y, z, intensity, got shape {array.shape}")
    count = len(array)
    red = _red_byte(array[:, 3])
    record = np.empty(count, dtype=[("xyz", "<f4", (3,)), ("rgb", "<u4")])
    record["xyz"] = array[:, :3]
    record["rgb"] = red * np.uint32(0x010101)
    with open(path, "wb") as handle:
        handle.write(_header_text(count, "binary" if binary else "ascii"))
        if binary:
            handle.write(record.tobytes())
            return
        columns = np.empty((count, 4), dtype=np.float64)
        columns[:, :3] = record["xyz"]
        columns[:, 3] = record["rgb"].view(np.float32)
        handle.write((("%.10g %.10g %.10g %.10g\n" * count) % tuple(columns.ravel().tolist())).encode("ascii"))
