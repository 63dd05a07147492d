"""Convert a dataset's ASCII .pcd clouds to binary .pcd once, so that loader workers stop parsing text.

A converted file keeps the original header byte for byte (comments, VERSION, FIELDS, SIZE, TYPE, COUNT, WIDTH,
HEIGHT, VIEWPOINT, POINTS) up to its DATA line, which becomes ``DATA binary``. Every value is stored at its
header's SIZE and TYPE, as ``pcd.read_pcd`` turns the ascii text into a number:

- F 4 columns that ``read_pcd`` reads as coordinates (the first x, y, z, and the first ``intensity``):
  float32(strtod(text)), taken from ``read_pcd``'s own output;
- every other F 4 column (``rgb``, normals, ...): the float32 strtof gives, as the reader computes it for an F
  colour's bits (``pcd._text_float32``, used here for every value the fast path below cannot prove); it is
  float32(strtod) except where strtod lands on a float32 midpoint;
- F 8: strtod(text);
- I and U: the integer strtod(text) is; a value that is not an integer or does not fit the type has no binary
  form, and the file fails (it stays ascii). Integers beyond 2**53 keep every digit of the text.

Then ``read_pcd(converted)`` is bit-equal to ``read_pcd(original)``, and every conversion is checked: the new file
is read back with ``read_pcd`` and compared bit for bit (float32 bits, so NaN rows compare too) with the original's,
with its header's fields and point counts, before it takes the final name. A file is written to a hidden temporary
name in its destination folder (``.NAME.*.pcd-convert.tmp``), fsynced, verified and renamed over the destination,
so a run killed at any moment leaves every .pcd either as it was or converted and verified, never torn.

Two modes over a dataset root (any .pcd below it: OPV2V/V2XSet, V2V4Real, DAIR-V2X-C):

- in place: each ascii .pcd is replaced by its binary form, only after the binary copy verified;
- mirror (``out``): the same relative paths under ``out``; ascii clouds are converted into it, binary ones and
  every other file (yaml, json, txt, ...) are hard-linked where the file system allows, else copied, so the mirror
  is a complete dataset. A hard-linked file is the same file as the source's: edit neither in place.

A .pcd that is a symbolic link is read through it; in place, the link is replaced by the converted file and its
target is left as it is.

Resuming: a re-run does only what is left. In place, a binary .pcd is skipped. In the mirror, a cloud is skipped
when its output exists, is binary, has the source's fields and point counts, holds all its points' bytes and is
not older than the source (only verified outputs ever get the final name, so such a file is the source's
conversion unless the source changed after it; a newer source is converted again). A linked or copied file is
skipped when it is the same file (a link), or has the source's size and modification time (``shutil.copy2``
keeps it). Temporary files of a killed run are never read as data (hidden, no .pcd suffix, never mirrored) and
are removed by the next run in the tree it writes into. Run one conversion of a tree at a time.

A mirror's top folder holds ``.convert_pcd_mirror``, the root it mirrors. An ``out`` that exists without it (a
mirror of an earlier version, or someone's folder) is taken only where nothing of it would be replaced: every file
there at a path of the dataset must already be the mirror's (a link or copy of the source, a conversion of it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import stat
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from opencood_ddp.data import pcd
from opencood_ddp.data.pcd import PcdHeader, read_pcd
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.numerics.jit import jit

__all__ = ["ConversionPlan", "FileResult", "Summary", "binary_mirror", "convert_file", "default_workers",
           "format_summary", "plan_conversion", "run_conversion"]

TEMP_SUFFIX = ".pcd-convert.tmp"
# In a mirror's top folder: the dataset root it mirrors. A mirror replaces its stale files; a folder without the
# mark is not known to be a mirror, and a file of it that differs from the dataset's may be someone's own.
MIRROR_MARK = ".convert_pcd_mirror"
CONVERTED, BINARY, DONE, FAILED = "converted", "binary", "done", "failed"

_HEAD_BYTES = 4096  # a .pcd header is a dozen short lines; longer ones are read in full
_TWO_POW_53 = 2.0**53
# Correctly rounded doubles 10**k for k in -300..300, for the compiled strtof fast path.
_POW10_WIDE = np.array([float(f"1e{k}") for k in range(-300, 301)])
# A double within a few ulps of the exact decimal rounds to strtof's float32 unless it is this close (relative) to a
# float32 midpoint; the reader's parser uses the same margin.
_NEAR_TIE = 2.0**-48


# ---------------------------------------------------------------------------------------------------------------
# One file: ascii bytes -> binary bytes
# ---------------------------------------------------------------------------------------------------------------


class _TokenText:
    """The text of any (row, column) token of an ascii body; the byte ranges of all tokens are found on first use
    (one numpy pass), since only rare values (float32 ties, huge integers, error messages) need their text."""

    def __init__(self, raw: bytes, header: PcdHeader):
        self._raw, self._header = raw, header
        self._starts: Optional[np.ndarray] = None
        self._ends: Optional[np.ndarray] = None

    def __call__(self, row: int, column: int) -> bytes:
        if self._starts is None:
            body = np.frombuffer(self._raw, dtype=np.uint8, offset=self._header.data_offset)
            # Tokens are split on bytes <= 32, as the reader's parser splits them.
            blank = np.concatenate(([True], body <= 32, [True]))
            edges = np.flatnonzero(blank[1:] != blank[:-1])
            self._starts, self._ends = edges[0::2], edges[1::2]
        index = row * self._header.values_per_point + column
        start = self._header.data_offset + int(self._starts[index])
        return self._raw[start:self._header.data_offset + int(self._ends[index])]


@jit
def _strtof_fast(body, starts, ends, pow10_wide, near_tie, bits, ok):
    """strtof's float32 bits of the tokens body[starts[k]:ends[k]] where a double approximation proves them.

    ``[+-]digits[.digits][(e|E)[+-]digits]`` with at most 19 significant digits and a power of ten within
    10**+-300 is approximated as one double (a few ulps off); its float32 rounding is strtof's unless the double
    lies next to a float32 midpoint or at float32's overflow edge. Every other token is left with ok[k] False.
    """
    scratch = np.empty(2, dtype=np.float32)
    scratch_bits = scratch.view(np.uint32)
    for k in range(starts.shape[0]):
        ok[k] = False
        i, end = starts[k], ends[k]
        negative = body[i] == 45
        if negative or body[i] == 43:
            i += 1
        mantissa = np.uint64(0)
        significant = 0
        digits = 0
        exponent = 0
        fraction = False
        while i < end:
            if body[i] == 46 and not fraction:
                fraction = True
                i += 1
                continue
            d = np.int64(body[i]) - 48
            if d < 0 or d > 9:
                break
            digits += 1
            if mantissa != 0 or d != 0:
                significant += 1
                if significant <= 19:
                    mantissa = mantissa * np.uint64(10) + np.uint64(d)
            if fraction and significant <= 19:
                exponent -= 1
            i += 1
        if i < end and (body[i] | 32) == 101:
            i += 1
            exp_negative = False
            if i < end and (body[i] == 45 or body[i] == 43):
                exp_negative = body[i] == 45
                i += 1
            power = 0
            exp_digits = 0
            while i < end and 48 <= body[i] <= 57:
                if power < 100000:
                    power = power * 10 + (np.int64(body[i]) - 48)
                exp_digits += 1
                i += 1
            if exp_digits == 0:
                continue
            exponent += -power if exp_negative else power
        if i != end or digits == 0 or significant > 19 or exponent < -300 or exponent > 300:
            continue
        approx = np.float64(mantissa) * pow10_wide[exponent + 300]
        scratch[0] = approx
        single = np.float64(scratch[0])
        rounded = scratch_bits[0]
        if rounded >= np.uint32(0x7F7FFFFF):  # at or beyond float32's largest: overflow rules, exact code decides
            continue
        if approx != single:
            scratch_bits[1] = rounded + np.uint32(1) if approx > single else rounded - np.uint32(1)
            midpoint = (single + np.float64(scratch[1])) * 0.5
            if abs(approx - midpoint) <= approx * near_tie:
                continue
        bits[k] = rounded | (np.uint32(0x80000000) if negative else np.uint32(0))
        ok[k] = True


def _parse_doubles(raw: bytes, header: PcdHeader, columns: list[int], path) -> tuple[np.ndarray, np.ndarray]:
    """strtod of the given ascii columns by the reader's compiled parser: (N, len(columns)) float64, and the tokens
    it left to exact code, (K, 4): point, index in columns, token start, token end (offsets in the body); their
    entries are 0 until filled."""
    # Imported on first use, as the reader does: numba's import is slow, and binary files never need it.
    from opencood_ddp.data import _ascii_numba as parser  # noqa: PLC0415

    per_row = header.values_per_point
    out_cols = np.full(per_row, -1, dtype=np.int64)
    modes = np.full(per_row, parser.SKIP, dtype=np.int64)
    out_cols[columns], modes[columns] = np.arange(len(columns)), parser.DOUBLE
    doubles = np.zeros((header.points, len(columns)), dtype=np.float64)
    body = np.frombuffer(raw, dtype=np.uint8, offset=header.data_offset)
    status, flagged = parser.parse_body(body, header.points, per_row, out_cols, modes, doubles)
    if status != parser.STATUS_OK:  # read_pcd accepted this body a moment ago: the file changed under us
        raise DataError(f"{path}: the file changed while it was converted; run the conversion again")
    return doubles, flagged


def _on_float32_midpoint(doubles: np.ndarray, singles: np.ndarray) -> np.ndarray:
    """Where float32(d) may not be strtof of d's text: d exactly on a float32 midpoint (double rounding can then
    go the wrong way) or beyond float32's range. Anywhere else both round the exact decimal to the same float32."""
    with np.errstate(invalid="ignore"):
        wide = singles.astype(np.float64)
        direction = np.where(doubles > wide, np.float32(np.inf), np.float32(-np.inf))
        midpoint = (wide + np.nextafter(singles, direction).astype(np.float64)) * 0.5
        return np.isfinite(doubles) & ((doubles == midpoint) | ~np.isfinite(singles))


def _exact_integer(text: bytes, value: float) -> int:
    """Every digit of a huge integer's text; strtod's integer where the text is not an integer literal."""
    try:
        exact = Fraction(text.decode("ascii"))
    except (ValueError, ZeroDivisionError):
        return int(value)
    return int(exact) if exact.denominator == 1 else int(value)


class _AsciiColumns:
    """The ascii body of one file, column by column, as the values its fields store in binary data (the rules of
    the module docstring). ``reference`` is read_pcd's output for the file: its F 4 coordinates are stored as
    they are; every other column is parsed here, once, by the reader's compiled parser."""

    def __init__(self, raw: bytes, header: PcdHeader, reference: np.ndarray, path):
        self.raw, self.header, self.reference, self.path = raw, header, reference, path
        self.fields = [field for field in header.fields for _ in range(field.count)]  # the field of each column
        self.from_reader = self._reader_columns()
        to_parse = [column for column in range(len(self.fields)) if column not in self.from_reader]
        self.slot = {column: index for index, column in enumerate(to_parse)}
        self.doubles, self.flagged = (_parse_doubles(raw, header, to_parse, path) if to_parse
                                      else (np.zeros((header.points, 0)), np.zeros((0, 4), dtype=np.int64)))
        self.text = _TokenText(raw, header)

    def _reader_columns(self) -> dict[int, int]:
        """Ascii column -> column of read_pcd's output, for the F 4 values read_pcd returns as they are stored."""
        names = ("x", "y", "z", "intensity") if self.header.field("intensity") is not None else ("x", "y", "z")
        columns = {self.header.column(name): index for index, name in enumerate(names)}
        return {column: index for column, index in columns.items()
                if (self.fields[column].type, self.fields[column].size) == ("F", 4)}

    def binary(self, column: int) -> np.ndarray:
        """The column as an array of its field's binary type."""
        field = self.fields[column]
        if column in self.from_reader:
            return self.reference[:, self.from_reader[column]]
        # A double beyond float32's range is inf in float32, as in read_pcd: no warning for that.
        with np.errstate(over="ignore"):
            if field.type == "F" and field.size == 4:
                return self._strtof(column)
            doubles = self._strtod(column)
            return doubles if field.type == "F" else self._integers(column, doubles)

    def _flagged_of(self, column: int) -> np.ndarray:
        """The tokens of one column the compiled parser left to exact code: (point, -, start, end) rows."""
        if len(self.slot) == 1:  # OPV2V's case (only rgb is parsed here): no mask over 90k rows
            return self.flagged
        return self.flagged[self.flagged[:, 1] == self.slot[column]]

    def _token(self, start: int, end: int) -> bytes:
        return self.raw[self.header.data_offset + start:self.header.data_offset + end]

    def _strtod(self, column: int) -> np.ndarray:
        """strtod of every token: the fast path's values, the flagged ones by the reader's exact code."""
        values = self.doubles[:, self.slot[column]].copy()
        for row, _, start, end in self._flagged_of(column).tolist():
            values[row] = pcd._text_double(self._token(start, end), row + 1, self.path)
        return values

    def _strtof(self, column: int) -> np.ndarray:
        """strtof of every token, as the reader computes it for an F colour."""
        flagged = self._flagged_of(column)
        doubles = self.doubles[:, self.slot[column]]
        singles = doubles.astype(np.float32)
        fast = np.ones(self.header.points, dtype=bool)
        fast[flagged[:, 0]] = False
        for row in np.flatnonzero(_on_float32_midpoint(doubles, singles) & fast).tolist():
            singles[row] = pcd._text_float32(self.text(row, column), row + 1, self.path)
        body = np.frombuffer(self.raw, dtype=np.uint8, offset=self.header.data_offset)
        bits = np.zeros(len(flagged), dtype=np.uint32)
        proven = np.zeros(len(flagged), dtype=bool)
        _strtof_fast(body, flagged[:, 2].copy(), flagged[:, 3].copy(), _POW10_WIDE, _NEAR_TIE, bits, proven)
        singles.view(np.uint32)[flagged[proven, 0]] = bits[proven]
        for row, _, start, end in flagged[~proven].tolist():
            singles[row] = pcd._text_float32(self._token(start, end), row + 1, self.path)
        return singles

    def _integers(self, column: int, doubles: np.ndarray) -> np.ndarray:
        """The integers of a TYPE I/U column, or DataError naming the first value binary data cannot hold."""
        field = self.fields[column]
        dtype = np.dtype(f"<{pcd._NUMPY_KINDS[field.type]}{field.size}")
        info = np.iinfo(dtype)
        with np.errstate(invalid="ignore"):
            integral = np.isfinite(doubles) & (np.trunc(doubles) == doubles)
        small = integral & (np.abs(doubles) < _TWO_POW_53)
        in_range = small & (doubles >= float(info.min)) & (doubles <= float(info.max))
        huge = integral & ~small  # beyond 2**53: from the text, digit for digit (8-byte timestamps, say)
        values = np.zeros(len(doubles), dtype=dtype)
        values[in_range] = doubles[in_range].astype(np.int64).astype(dtype)
        bad = ~in_range & ~huge
        for row in np.flatnonzero(huge).tolist():
            exact = _exact_integer(self.text(row, column), doubles[row])
            if info.min <= exact <= info.max:
                values[row] = exact
            else:
                bad[row] = True
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{self.path}: ascii data row {row + 1} has {self.text(row, column)[:30]!r} in field {field.name!r} "
                f"(TYPE {field.type} SIZE {field.size}), which binary data cannot hold; fix the value or leave the "
                "file ascii"
            )
        return values


def _binary_body(header: PcdHeader, columns: list[np.ndarray]) -> bytes:
    """The points as the reader's binary records: little-endian fields at the header's offsets."""
    records = np.zeros(header.points, dtype=pcd._structured_dtype(header))
    column = 0
    for index, field in enumerate(header.fields):
        target = records[f"f{index}"]
        for element in range(field.count):
            (target if field.count == 1 else target[:, element])[...] = columns[column]
            column += 1
    return records.tobytes()


def _binary_header(raw: bytes, header: PcdHeader) -> bytes:
    """The original header byte for byte, its last line (DATA ascii) replaced by DATA binary."""
    end = header.data_offset - 1 if raw[header.data_offset - 1:header.data_offset] == b"\n" else header.data_offset
    start = raw.rfind(b"\n", 0, end) + 1
    assert raw[start:end].split()[0] == b"DATA", "the reader's header ends at its DATA line"
    return raw[:start] + b"DATA binary\n"


# ---------------------------------------------------------------------------------------------------------------
# One file: write, verify, rename
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FileResult:
    """What happened to one .pcd: converted, binary (skipped: already binary), done (skipped: the mirror holds
    its conversion from an earlier run) or failed (``error``: one line naming the file and the fix)."""

    source: str
    action: str
    bytes_before: int
    bytes_after: int
    error: str = ""


def _read_header(path: Path) -> PcdHeader:
    """The header from the file's first bytes (a conversion's resume checks read thousands of them)."""
    with open(path, "rb") as handle:
        head = handle.read(_HEAD_BYTES)
    try:
        return pcd._parse_header(head, path)
    except DataError:
        if len(head) < _HEAD_BYTES:
            raise
        return pcd.read_pcd_header(path)  # a header longer than the first bytes: read it whole


def _same_layout(a: PcdHeader, b: PcdHeader) -> bool:
    return (a.fields, a.width, a.height, a.points) == (b.fields, b.width, b.height, b.points)


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    row = int(np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=1))[0])
    return f"point {row}: {a[row].tolist()} read as {b[row].tolist()}"


def _verify(converted: Path, source: Path, header: PcdHeader, header_bytes: bytes, reference: np.ndarray) -> None:
    """The converted file reads back as the original: header and fields, point count, read_pcd's bits."""
    def bug(detail: str) -> DataError:
        return DataError(f"{source}: its binary copy does not read back as the original ({detail}); the original "
                         "is kept: leave this file ascii and report the file to the project")

    try:
        raw = pcd._read_bytes(converted)
        new_header = pcd._parse_header(raw, converted)
        values = read_pcd(converted)
    except DataError as error:
        raise bug(str(error)) from None
    if not raw.startswith(header_bytes) or new_header.data != "binary" or not _same_layout(header, new_header):
        raise bug("header")
    if values.shape != reference.shape:
        raise bug(f"{len(values)} points, the original has {len(reference)}")
    if not np.array_equal(values.view(np.uint32), reference.view(np.uint32)):
        raise bug(_first_difference(reference, values))


def _write_verified(dest: Path, parts: Iterable[bytes], mode: int, verify: Callable[[Path], None]) -> None:
    """atomic.atomic_write's sequence (temporary file beside dest, fsync, os.replace) with the check between the
    fsync and the rename, so an unverified file never takes dest's name; the temporary file is removed on any
    failure or interruption."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=TEMP_SUFFIX, dir=dest.parent)
    temporary = Path(name)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; the converted file keeps the original's permissions
        with os.fdopen(fd, "wb") as handle:
            for part in parts:
                handle.write(part)
            handle.flush()
            os.fsync(handle.fileno())
        verify(temporary)
        os.replace(temporary, dest)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _is_current_copy(source: Path, dest: Path) -> bool:
    """dest is source's link, or its copy by shutil.copy2 (same size and modification time)."""
    try:
        if os.path.samefile(source, dest):
            return True
        ours, theirs = source.stat(), dest.stat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(theirs.st_mode) and (ours.st_size, ours.st_mtime_ns) == (theirs.st_size, theirs.st_mtime_ns)


def _mirror_file(source: Path, dest: Path) -> None:
    """dest becomes a hard link to source where the file system allows, else a copy; atomically, and not again
    when it already is one."""
    if _is_current_copy(source, dest):
        return
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=TEMP_SUFFIX, dir=dest.parent)
    os.close(fd)
    temporary = Path(name)
    try:
        temporary.unlink()  # os.link needs a free name; mkstemp only reserved a unique one
        try:
            os.link(source, temporary)
        except OSError:  # another file system, or links not allowed: copy, keeping the modification time
            shutil.copy2(source, temporary)
        os.replace(temporary, dest)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _already_converted(source: Path, header: PcdHeader, dest: Path) -> bool:
    """The mirror's resume rule (module docstring): dest is a complete, binary conversion of today's source."""
    try:
        dest_stat = dest.stat()
        dest_header = _read_header(dest)
    except (FileNotFoundError, DataError):
        return False
    return (dest_header.data == "binary" and _same_layout(header, dest_header)
            and dest_stat.st_size >= dest_header.data_offset + dest_header.points * dest_header.point_size
            and dest_stat.st_mtime_ns >= source.stat().st_mtime_ns)


def _convert(source: Path, dest: Path, dry_run: bool) -> FileResult:
    size = source.stat().st_size
    header = _read_header(source)
    if header.data != "ascii":
        if dest != source and not dry_run:
            _mirror_file(source, dest)
        return FileResult(str(source), BINARY, size, size)
    if dest != source and _already_converted(source, header, dest):
        return FileResult(str(source), DONE, size, dest.stat().st_size)
    if dry_run:
        return FileResult(str(source), CONVERTED, size, 0)
    raw = pcd._read_bytes(source)
    header = pcd._parse_header(raw, source)
    reference = read_pcd(source)  # the values to reproduce; raises the reader's error for a bad file
    header_bytes = _binary_header(raw, header)
    columns = _AsciiColumns(raw, header, reference, source)
    body = _binary_body(header, [columns.binary(column) for column in range(header.values_per_point)])
    _write_verified(dest, (header_bytes, body), stat.S_IMODE(source.stat().st_mode),
                    lambda converted: _verify(converted, source, header, header_bytes, reference))
    return FileResult(str(source), CONVERTED, size, len(header_bytes) + len(body))


def convert_file(source, dest=None, dry_run: bool = False) -> FileResult:
    """Convert one ascii .pcd into a verified binary one at ``dest`` (default: in place); see the module docstring.

    A bad input or a failed check comes back as a FAILED result whose ``error`` names the file and the fix; the
    original is never touched then, and in a mirror no output is left for it.
    """
    source = Path(source)
    dest = source if dest is None else Path(dest)
    try:
        return _convert(source, dest, dry_run)
    except DataError as error:
        message = str(error)
    except OSError as error:
        message = (f"{source}: cannot convert ({error.strerror or error}: {error.filename or dest}); "
                   "free disk space or fix the permissions, then run again")
    if dest != source and not dry_run:
        with contextlib.suppress(OSError):
            dest.unlink(missing_ok=True)  # a stale output must not pass for the conversion of this source
    size = source.stat().st_size if source.is_file() else 0
    return FileResult(str(source), FAILED, size, size if dest == source else 0, message)


# ---------------------------------------------------------------------------------------------------------------
# A dataset
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConversionPlan:
    """What a run works on: the clouds (relative paths, biggest first, so that the last files handed to the
    workers are the shortest), the other files to mirror, the folders, and leftovers of a killed run."""

    root: Path
    out: Optional[Path]
    clouds: tuple[tuple[Path, int], ...]  # (relative path, bytes)
    others: tuple[Path, ...]  # relative paths of the non-.pcd files (mirrored only)
    folders: tuple[Path, ...]  # relative paths of every folder below the root
    leftovers: tuple[Path, ...]  # temporary files of an interrupted run in the tree this run writes into

    @property
    def cloud_bytes(self) -> int:
        return sum(size for _, size in self.clouds)

    def dest(self, relative: Path) -> Path:
        return (self.out if self.out is not None else self.root) / relative


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def _unreadable_folder(error: OSError) -> None:
    raise DataError(f"{error.filename}: cannot list this folder ({error.strerror}); fix its permissions, then run "
                    "again")


def _walk(root: Path) -> Iterable[tuple[Path, list[str], list[str]]]:
    """os.walk in sorted order, failing on a folder it cannot list (os.walk would skip it silently)."""
    for folder, subfolders, files in os.walk(root, onerror=_unreadable_folder):
        subfolders.sort()
        yield Path(folder), subfolders, sorted(files)


def _check_roots(root: Path, out: Optional[Path]) -> None:
    if not root.is_dir():
        raise DataError(f"{root}: dataset folder not found; pass the folder that holds the .pcd files "
                        "(e.g. /data/opv2v)")
    if out is None:
        return
    real_root, real_out = root.resolve(), out.resolve()
    if real_out == real_root or real_out.is_relative_to(real_root):
        raise ConfigError(f"--out {out} is inside the dataset root {root}; choose a folder outside it, "
                          f"e.g. {root.resolve()}_binary")
    if real_root.is_relative_to(real_out):
        raise ConfigError(f"--out {out} holds the dataset root {root}; choose a folder outside it, "
                          f"e.g. {root.resolve()}_binary")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a new or earlier mirror folder")


def _is_mirror_of(source: Path, dest: Path) -> bool:
    """dest, where it exists, is what a mirror of source holds: its link or copy, or its verified conversion."""
    if not dest.exists() or _is_current_copy(source, dest):
        return True
    if source.suffix.lower() != ".pcd":
        return False
    try:  # the resume rule's layout and age, then the points themselves: the folder is not known to be ours
        return (_already_converted(source, _read_header(source), dest)
                and np.array_equal(read_pcd(source).view(np.uint32), read_pcd(dest).view(np.uint32)))
    except (DataError, OSError):  # an unreadable source or a broken link: the run reports it, not this check
        return True


def _check_mirror_out(root: Path, out: Path, clouds: list, others: list) -> None:
    """An existing ``out``: the mirror of ``root`` by its mark, or a folder where no file would be replaced."""
    mark = out / MIRROR_MARK
    if mark.is_file():
        mirrored = mark.read_text().strip()
        if mirrored != str(root.resolve()):
            raise ConfigError(f"--out {out} is the mirror of {mirrored}, not of {root}; pass another folder")
        return
    replaced = [relative for relative in (*clouds, *others) if not _is_mirror_of(root / relative, out / relative)]
    if replaced:
        more = f" and {len(replaced) - 1} more" if len(replaced) > 1 else ""
        raise ConfigError(f"--out {out} holds {out / replaced[0]}{more}, which differs from the dataset's file and "
                          f"is not marked as this tool's mirror ({MIRROR_MARK}); move it away, or pass a new folder")


def plan_conversion(root, out=None) -> ConversionPlan:
    """Walk ``root`` for every .pcd (and, for a mirror into ``out``, every other file); refuse a missing root, an
    ``out`` inside the root or holding it, and a root without any .pcd, each in one line."""
    root = Path(root)
    out = Path(out) if out is not None else None
    _check_roots(root, out)
    clouds, others, folders, leftovers = [], [], [], []
    for folder, _, files in _walk(root):
        relative = folder.relative_to(root)
        folders.append(relative)
        for name in files:
            if _is_temporary(name):
                if out is None:
                    leftovers.append(folder / name)
                continue  # never mirrored, never read
            if name == MIRROR_MARK and folder == root:
                continue  # a mirror's own mark: a mirror of it gets its own, not a link to this one
            path = folder / name
            if name.lower().endswith(".pcd"):  # a broken link: size 0 here, the reader's 'not found' later
                clouds.append((relative / name, path.stat().st_size if path.exists() else 0))
            else:
                others.append(relative / name)
    if not clouds:
        raise DataError(f"{root}: no .pcd file below this folder; pass the dataset's root (e.g. /data/opv2v)")
    if out is not None and out.is_dir():
        leftovers = [folder / name for folder, _, files in _walk(out) for name in files if _is_temporary(name)]
        _check_mirror_out(root, out, [relative for relative, _ in clouds], others)
    clouds.sort(key=lambda item: (-item[1], item[0]))
    return ConversionPlan(root, out, tuple(clouds), tuple(others), tuple(folders), tuple(leftovers))


@dataclasses.dataclass
class Summary:
    """The counts of a run; bytes are the dataset's .pcd files before and after it."""

    dry_run: bool
    out: Optional[Path]
    workers: int
    converted: int = 0
    binary: int = 0
    done: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    others: int = 0
    leftovers_removed: int = 0
    seconds: float = 0.0

    def add(self, result: FileResult) -> None:
        if result.action == FAILED:
            self.failed.append(result.error)
        else:
            setattr(self, result.action, getattr(self, result.action) + 1)
        self.bytes_before += result.bytes_before
        self.bytes_after += result.bytes_after


def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def _prepare_tree(plan: ConversionPlan, summary: Summary) -> None:
    """Remove a killed run's temporary files; for a mirror, make its folders and link or copy the other files."""
    for leftover in plan.leftovers:
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
            summary.leftovers_removed += 1
    if plan.out is None:
        return
    for folder in plan.folders:
        (plan.out / folder).mkdir(parents=True, exist_ok=True)
    (plan.out / MIRROR_MARK).write_text(f"{plan.root.resolve()}\n")  # before any file of it is replaced
    for relative in plan.others:
        try:
            _mirror_file(plan.root / relative, plan.out / relative)
        except OSError as error:
            raise DataError(f"{plan.out / relative}: cannot link or copy {plan.root / relative} into the mirror "
                            f"({error.strerror or error}); fix the permissions or free space, then run again") \
                from None
        summary.others += 1


def _load_parsers() -> None:
    """Load the compiled parsers (compiling them the first time) in this process, so that forked workers inherit
    them instead of each compiling its own copy at the same moment (seconds each)."""
    from opencood_ddp.data import _ascii_numba as parser  # noqa: PLC0415

    body = np.frombuffer(b"1 2", dtype=np.uint8)  # read-only, as the bodies of files read into bytes are
    columns, modes = np.array([0, -1]), np.array([parser.DOUBLE, parser.SKIP])
    for dtype in (np.float32, np.float64):  # read_pcd's output, and the strtod columns here
        parser.parse_body(body, 1, 2, columns, modes, np.zeros((1, 1), dtype=dtype))
    _strtof_fast(body, np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), _POW10_WIDE, _NEAR_TIE,
                 np.zeros(1, dtype=np.uint32), np.zeros(1, dtype=bool))


def _results(plan: ConversionPlan, workers: int, dry_run: bool) -> Iterable[FileResult]:
    """convert_file on every cloud, on ``workers`` processes (in this one for 1), as the results come in."""
    jobs = [(plan.root / relative, plan.dest(relative), dry_run) for relative, _ in plan.clouds]
    if workers == 1 or len(jobs) == 1 or dry_run:
        yield from (convert_file(*job) for job in jobs)
        return
    _load_parsers()
    executor = concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)))
    try:
        futures = [executor.submit(convert_file, *job) for job in jobs]  # biggest first: the queue's order
        for future in concurrent.futures.as_completed(futures):
            yield future.result()
    finally:
        # On an interrupt the workers stop too (they share the terminal's SIGINT) and remove their temporary files.
        executor.shutdown(wait=True, cancel_futures=True)


def run_conversion(plan: ConversionPlan, workers: Optional[int] = None, dry_run: bool = False,
                   on_result: Optional[Callable[[FileResult], None]] = None) -> Summary:
    """Convert every ascii cloud of the plan (in place, or into its mirror with the other files linked or copied).

    ``on_result`` is called in this process with each cloud's FileResult as it completes (a progress bar). A dry
    run reads headers only and writes nothing.
    """
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ConfigError(f"--workers {workers}: need at least 1 process; pass --workers 1 or more")
    summary = Summary(dry_run=dry_run, out=plan.out, workers=workers)
    started = time.perf_counter()
    if dry_run:
        summary.others = len(plan.others) if plan.out is not None else 0
    else:
        _prepare_tree(plan, summary)
    for result in _results(plan, workers, dry_run):
        summary.add(result)
        if on_result is not None:
            on_result(result)
    summary.seconds = time.perf_counter() - started
    return summary


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def format_summary(summary: Summary) -> str:
    """The end-of-run paragraph: counts, bytes before and after, time."""
    if summary.dry_run:
        lines = [f"dry run: would convert {summary.converted} ascii .pcd files ({_megabytes(summary.bytes_before)} "
                 f"of .pcd in all); skip {summary.binary} (already binary) and {summary.done} (converted by an "
                 f"earlier run); {len(summary.failed)} unreadable"]
        if summary.out is not None:
            lines.append(f"would link or copy {summary.others} other files into {summary.out}")
        return "\n".join(lines)
    lines = [f"converted {summary.converted} .pcd files; skipped {summary.binary} (already binary) and "
             f"{summary.done} (converted by an earlier run); failed {len(summary.failed)}",
             f".pcd bytes: {_megabytes(summary.bytes_before)} before, {_megabytes(summary.bytes_after)} after"]
    if summary.out is not None:
        lines.append(f"mirror {summary.out}: {summary.others} other files there (hard links or copies)")
    if summary.leftovers_removed:
        lines.append(f"removed {summary.leftovers_removed} temporary files of an interrupted run")
    lines.append(f"{summary.seconds:.1f} s with {summary.workers} worker process(es)")
    if summary.failed:
        lines.append(f"{len(summary.failed)} files failed (listed above); fix them and run the same command again")
    return "\n".join(lines)


def binary_mirror(root, workers: Optional[int] = None) -> Path:
    """The binary mirror of the data set ``root`` beside it (``<root>_binary``), made, or completed where a run
    stopped, by ``run_conversion``: what the benchmarks and gpu_check read binary clouds from. A file that fails is
    a DataError naming it."""
    root = Path(root)
    mirror = root.with_name(f"{root.name}_binary")
    summary = run_conversion(plan_conversion(root, mirror), workers)
    if summary.failed:
        raise DataError(f"converting {root} into {mirror} failed: {summary.failed[0]}")
    return mirror

