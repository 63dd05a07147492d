"""The ascii .pcd body parser of ``pcd.read_pcd``: one pass over the bytes, compiled with numba.

``parse_body`` walks the body bytes once: it splits tokens on bytes <= 32 (space, tab, CR, LF and control bytes),
checks that every row of values sits on its own line (rows end at CR or LF; the values of a row share a line and
rows come on increasing lines), and parses the tokens of the columns ``read_pcd`` keeps into the (N, 4) float32
output:

- a number ``[+-]digits[.digits][(e|E)[+-]digits]`` is read as a uint64 mantissa of at most 19 significant digits
  and a power of ten E;
- doubles (x, y, z, an ``intensity`` field, integer colours): Clinger's fast path, mantissa < 2**53 and
  |E| <= 22, where one multiply or divide of two exact doubles is the correctly rounded strtod result;
- float32 colours (strtof): a double within a few ulps of the exact value rounds to the right float32 unless it
  lies next to a float32 midpoint;
- anything else (nan, inf, hex, junk, more than 19 significant digits, an exponent out of range, a value next to a
  float32 midpoint, an integer colour beyond int64) is not guessed: the token is returned in ``flagged`` and
  ``pcd.py`` computes it with exact Python code, so every value is strtod's or strtof's, bit for bit.

When the token count or the row layout is wrong the status is non-zero and ``pcd.py`` explains the error.
"""

from __future__ import annotations

import numpy as np

from opencood_ddp.numerics.jit import jit

# What the parser does with the tokens of a column (``modes``).
SKIP = 0
DOUBLE = 1  # strtod, then cast to float32 (x, y, z, intensity)
FLOAT32_BITS = 2  # strtof, keep the red byte of the float's bits (TYPE F colour)
INTEGER_BITS = 3  # strtod, truncated, keep the red byte of the low 32 bits (TYPE U / I colour; |value| < 2**63)

STATUS_OK = 0
STATUS_LAYOUT = 1  # wrong number of tokens or rows not on their own lines: pcd.py explains which

_POW10 = np.array([10.0**k for k in range(23)])  # exact doubles
# Correctly rounded doubles 10**k for k in -300..300 (Python's float of the decimal literal).
_POW10_WIDE = np.array([float(f"1e{k}") for k in range(-300, 301)])
_TWO_POW_53 = 1 << 53
_TWO_POW_63 = 2.0**63
_NEAR_TIE = 2.0**-48  # a ~3 ulp double approximation is only trusted this far (relative) from a float32 midpoint
_RED_TO_INTENSITY = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)


@jit
def _parse_body(body, points, per_row, out_cols, modes, pow10, pow10_wide, red_to_intensity, out):
    """Fill ``out`` and return (status, flagged): flagged rows are (point, out column, token start, token end)."""
    n = body.shape[0]
    total = points * per_row
    flagged = np.empty((64, 4), dtype=np.int64)
    n_flagged = 0
    scratch = np.empty(2, dtype=np.float32)
    scratch_bits = scratch.view(np.uint32)

    i = 0
    token = 0
    row = 0
    col = 0
    line = 0  # newlines before the current byte
    row_line = 0
    fast_ok = True  # the usual layout: separators inside a row are blanks, rows end with CR/LF
    exact_ok = True  # the rule itself: a row's tokens share one line, rows on increasing lines (blank lines allowed)
    while True:
        while i < n and body[i] <= 32:
            if body[i] == 10:
                line += 1
            i += 1
        if i >= n:
            break
        if token >= total:
            return STATUS_LAYOUT, flagged[:0]
        start = i
        mode = modes[col]
        target = out_cols[col]
        if mode == SKIP:
            while i < n and body[i] > 32:
                i += 1
        else:
            # [+-]digits[.digits][(e|E)[+-]digits], anything else is flagged.
            good = True
            negative = False
            c = body[i]
            if c == 45 or c == 43:
                negative = c == 45
                i += 1
            # The integer and the fraction digits are two loops written out, not one helper: the helper (a numba
            # function, inlined or not) made this parse 15 % slower, 13.0 against 11.5 ms per 100k-point cloud
            # (tools/benchmarks/benchmark_pcd.py, 5 repeats).
            mantissa = np.uint64(0)
            significant = 0
            digits = 0
            exponent = 0
            while i < n:
                d = np.int64(body[i]) - 48
                if d < 0 or d > 9:
                    break
                digits += 1
                if significant < 19:
                    if mantissa != 0 or d != 0:
                        mantissa = mantissa * np.uint64(10) + np.uint64(d)
                        significant += 1
                else:
                    significant += 1  # a 20th significant digit: flagged below
                i += 1
            if i < n and body[i] == 46:
                i += 1
                while i < n:
                    d = np.int64(body[i]) - 48
                    if d < 0 or d > 9:
                        break
                    digits += 1
                    if significant < 19:
                        if mantissa != 0 or d != 0:
                            mantissa = mantissa * np.uint64(10) + np.uint64(d)
                            significant += 1
                        exponent -= 1
                    else:
                        significant += 1
                    i += 1
            if digits == 0:
                good = False
            if i < n and (body[i] | 32) == 101:
                i += 1
                exp_negative = False
                if i < n and (body[i] == 45 or body[i] == 43):
                    exp_negative = body[i] == 45
                    i += 1
                exp_digits = 0
                power = 0
                while i < n:
                    d = np.int64(body[i]) - 48
                    if d < 0 or d > 9:
                        break
                    if power < 100000:
                        power = power * 10 + d
                    exp_digits += 1
                    i += 1
                if exp_digits == 0:
                    good = False
                exponent += -power if exp_negative else power
            if i < n and body[i] > 32:
                good = False
                while i < n and body[i] > 32:
                    i += 1
            if significant > 19:
                good = False
            if good and mode == FLOAT32_BITS:
                if exponent < -300 or exponent > 300:
                    good = False
                else:
                    approx = np.float64(mantissa) * pow10_wide[exponent + 300]
                    scratch[0] = approx
                    single = np.float64(scratch[0])
                    bits = scratch_bits[0]
                    if bits >= np.uint32(0x7F7FFFFF):  # at or beyond float32's largest: overflow rules, let strtof say
                        good = False
                    elif approx != single:
                        # The float32 midpoint on approx's side of single (exact in double).
                        scratch_bits[1] = bits + np.uint32(1) if approx > single else bits - np.uint32(1)
                        midpoint = (single + np.float64(scratch[1])) * 0.5
                        if abs(approx - midpoint) <= approx * _NEAR_TIE:
                            good = False
                    if good:
                        red = (bits >> np.uint32(16)) & np.uint32(0xFF)  # the sign bit is not in the red byte
                        out[row, target] = red_to_intensity[red]
            elif good:
                if mantissa >= np.uint64(_TWO_POW_53) or exponent < -22 or exponent > 22:
                    good = False
                else:
                    value = np.float64(mantissa)
                    if exponent >= 0:
                        value = value * pow10[exponent]
                    else:
                        value = value / pow10[-exponent]
                    if negative:
                        value = -value
                    if mode == DOUBLE:
                        out[row, target] = value
                    elif abs(value) >= _TWO_POW_63:
                        good = False
                    else:
                        red = (np.int64(value) >> 16) & 0xFF
                        out[row, target] = red_to_intensity[red]
            if not good:
                if n_flagged == flagged.shape[0]:
                    grown = np.empty((2 * n_flagged, 4), dtype=np.int64)
                    grown[:n_flagged] = flagged
                    flagged = grown
                flagged[n_flagged, 0] = row
                flagged[n_flagged, 1] = target
                flagged[n_flagged, 2] = start
                flagged[n_flagged, 3] = i
                n_flagged += 1
        # The two layout checks, on the byte after the token (a blank past the end).
        after = body[i] if i < n else np.uint8(32)
        if col < per_row - 1:
            if after != 32 and after != 9:
                fast_ok = False
        elif row < points - 1 and after != 10 and after != 13:
            fast_ok = False
        if col == 0:
            if row > 0 and line <= row_line:
                exact_ok = False
            row_line = line
        elif line != row_line:
            exact_ok = False
        token += 1
        col += 1
        if col == per_row:
            col = 0
            row += 1
    if token != total or not (fast_ok or exact_ok):
        return STATUS_LAYOUT, flagged[:0]
    return STATUS_OK, flagged[:n_flagged]


def parse_body(body: np.ndarray, points: int, per_row: int, out_cols: np.ndarray, modes: np.ndarray,
               out: np.ndarray) -> tuple[int, np.ndarray]:
    """Parse the uint8 ``body`` into ``out`` (N, 4 float32); see the module docstring."""
    return _parse_body(body, points, per_row, out_cols, modes, _POW10, _POW10_WIDE, _RED_TO_INTENSITY, out)


__all__ = ["DOUBLE", "FLOAT32_BITS", "INTEGER_BITS", "SKIP", "STATUS_LAYOUT", "STATUS_OK", "parse_body"]
