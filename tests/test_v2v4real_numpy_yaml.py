"""V2V4Real's frame reader builds the numpy objects in a frame yaml exactly as PyYAML's unsafe loader does.

A round trip: a table of numpy values (scalars, ndarrays and dtypes of every number type in both byte orders,
nested in lists, tuples and mappings) is written by PyYAML's own ``yaml.dump`` (the default Dumper), in every
style it has, and read back by our safe reader on each of its routes: ``V2V4RealYamlLoader`` itself, fast_yaml's
route, and the frame read path (``read_v2v4real_frame`` -> ``load_opv2v_yaml``). The reference is
``yaml.load(text, Loader=yaml.Loader)`` (the unsafe loader V2V4Real's own reader uses) on the same text: values and
types must be the same, and the reference is checked to hold the table's values.

Every text is a real dump, but for two substitutions (numpy 1's module name and older numpy's 0/1 dtype flags: see
_variants). Forms a plain numpy value never dumps to (a scalar's mapping form, a scalar with a non-native dtype) are
real dumps too, of an object whose pickle reduce is given (_Reduced): represent_object writes them exactly as it
would the numpy value that reduce describes.
"""
from __future__ import annotations

import copyreg
import os
import pathlib
import re

import numpy as np
import pytest
import yaml

from opencood_ddp.data import fast_yaml
from opencood_ddp.data.opv2v import CavRecord, load_opv2v_yaml
from opencood_ddp.data.sources.v2v4real import V2V4RealYamlLoader, dumped_ndarray_key, read_v2v4real_frame
from opencood_ddp.errors import DataError

SCALAR = np.float64(0).__reduce__()[0]  # numpy's scalar(dtype, bytes), the call a numpy scalar's reduce names


class _Reduced:
    """An object whose pickle reduce is ``reduce``: yaml.dump writes it as it writes any object with that reduce."""

    def __init__(self, reduce: tuple):
        self.reduce = reduce

    def __reduce_ex__(self, protocol):
        return self.reduce


def _longdouble_round_trips() -> bool:
    value = np.longdouble(1) / np.longdouble(3)
    back = yaml.load(yaml.dump(value), Loader=yaml.Loader)
    return type(back) is np.longdouble and back == value


# Every number dtype, in both byte orders where it has one: 3 single-byte + 2 x 11 (+ 2 x 2 long double) = 25 (29)
ONE_BYTE_CODES = ("?", "i1", "u1")
MULTI_BYTE_CODES = ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16") + \
    (("g", "G") if _longdouble_round_trips() else ())
DTYPES = tuple(np.dtype(code) for code in ONE_BYTE_CODES) + \
    tuple(np.dtype(order + code) for code in MULTI_BYTE_CODES for order in "<>")


def _name(dtype: np.dtype) -> str:
    """A plain key for ``dtype``: b1, le_f8, be_f8 (a key fast_yaml's routes read)."""
    return {"|": "", "<": "le_", ">": "be_"}[dtype.str[0]] + dtype.str[1:]


def _data(dtype: np.dtype, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` values of ``dtype`` from random bit patterns (NaNs with payloads, infinities, subnormals, -0.0,
    every integer bit); a bool only 0 or 1 (another byte is no bool numpy makes)."""
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(dtype)
    return np.frombuffer(rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).tobytes(), dtype=dtype).copy()


def _arrays(dtype: np.dtype, rng: np.random.Generator) -> dict:
    """10 ndarrays of ``dtype``: 0-d to 3-d, empty, C and Fortran order, two non-contiguous views."""
    flat = _data(dtype, 24, rng)
    grid = flat.reshape(4, 6)
    return {"0d": flat[:1].reshape(()), "empty": flat[:0], "empty_3d": flat[:0].reshape(2, 0, 3), "1d": flat[:5],
            "2d_c": grid[:3, :4].copy(), "2d_f": np.asfortranarray(grid[:3, :4]), "3d_c": flat.reshape(2, 3, 4),
            "3d_f": np.asfortranarray(flat.reshape(2, 3, 4)), "strided": grid[::2, 1::2], "strided_t": grid[::2, ::3].T}


def _scalars(dtype: np.dtype, rng: np.random.Generator) -> dict:
    """4 scalars of ``dtype``'s type: two in the sequence form yaml.dump writes for a numpy scalar (a real scalar
    where ``dtype`` is native: numpy's scalars always are), two in the mapping form, which represent_object writes
    for the same reduce with a false state that is not a dict (the unsafe loader skips a false state)."""
    values = _data(dtype, 2, rng)
    forms = {}
    for k in range(2):
        args = (dtype, values[k:k + 1].tobytes())
        forms[f"seq{k}"] = values[k] if dtype.isnative else _Reduced((SCALAR, args))
        forms[f"map{k}"] = _Reduced((SCALAR, args, ()))
    return forms


def _table() -> dict:
    """The round trip's document: 29 x 10 arrays and 29 dtypes at the top level (fast_yaml reads top-level keys
    apart), 29 x 4 scalars in one mapping, and a nested group (lists, tuples, mappings in each other)."""
    rng = np.random.default_rng(36)
    table = {"lidar_pose": np.arange(16.0).reshape(4, 4) * 0.5 - 3.0, "scalars": {}, "dtypes": {}}
    for dtype in DTYPES:
        table.update({f"{_name(dtype)}_{shape}": array for shape, array in _arrays(dtype, rng).items()})
        table["scalars"].update({f"{_name(dtype)}_{form}": value for form, value in _scalars(dtype, rng).items()})
        table[f"dtype_{_name(dtype)}"] = dtype
        table["dtypes"][_name(dtype)] = [dtype]
    table["gps"] = [np.float64(31.2), np.float64(-121.4), np.float32(4.5)]
    table["nested"] = {"list": [np.int16(-7), _data(np.dtype(">f4"), 3, rng), np.dtype("<c8"), [np.uint8(255)]],
                       "tuple": (np.bool_(True), (np.asfortranarray(_data(np.dtype("i8"), 6, rng).reshape(2, 3)),)),
                       "mapping": {"inner": {"pose": np.eye(4), "speed": np.float64(7.25), "kind": np.dtype("u2")}}}
    return table


TABLE = _table()
STYLES = [(flow, sort) for flow in (False, True, None) for sort in (True, False)]


def _variants(text: str) -> dict:
    """The text as this numpy writes it, as numpy 1 writes it (module numpy.core.multiarray: substituted, the rest
    of numpy 1's form is the same), and as older numpy wrote a dtype's align and copy flags (0 and 1 for false and
    true, PyYAML issue 286: substituted)."""
    older = re.sub(r"(\n *- )false(\n *- )true(\n *state:)", r"\g<1>0\g<2>1\g<3>", text)
    older = re.sub(r"args: \[([a-z0-9]+), false, true\]", r"args: [\1, 0, 1]", older)
    assert older != text
    return {"numpy 2": text, "numpy 1": text.replace("numpy._core.multiarray", "numpy.core.multiarray"),
            "older numpy flags": older}


def _typed(value):
    """A comparable form keeping every type: an array's dtype, byte order, shape, layout flags and bytes; a scalar's
    type and bytes (NaNs exact); a dtype's type and str."""
    if isinstance(value, dict):
        return ("dict", [(_typed(key), _typed(item)) for key, item in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(item) for item in value])
    if isinstance(value, np.ndarray):
        flags = value.flags
        return (type(value), value.dtype.str, value.shape, flags.c_contiguous, flags.f_contiguous, flags.writeable,
                flags.owndata, value.tobytes(order="A"))
    if isinstance(value, np.generic):
        return (type(value), value.dtype.str, value.tobytes())
    if isinstance(value, np.dtype):
        return (type(value), value.str)
    return (type(value), value)


def _holds(reference, original) -> None:
    """The unsafe loader's value holds ``original``'s values (a check of the table, not of our reader)."""
    if isinstance(original, dict):
        assert sorted(reference) == sorted(original)  # the order is the dump's (sort_keys): _typed compares it
        for key in original:
            _holds(reference[key], original[key])
    elif isinstance(original, (list, tuple)):
        assert type(reference) is type(original) and len(reference) == len(original)
        for item, expected in zip(reference, original):
            _holds(item, expected)
    elif isinstance(original, np.ndarray):
        assert type(reference) is np.ndarray and reference.shape == original.shape
        assert reference.dtype.newbyteorder("=") == original.dtype.newbyteorder("=")
        assert np.ascontiguousarray(reference.astype(original.dtype)).tobytes() == \
            np.ascontiguousarray(original).tobytes()
    elif isinstance(original, _Reduced):  # a scalar: its dtype and bytes (a long double's padding is no value)
        dtype, data = original.reduce[1]
        assert type(reference) is dtype.type
        assert np.array_equal(reference, np.frombuffer(data, dtype=dtype)[0], equal_nan=dtype.kind in "fc")
    elif isinstance(original, np.generic):
        assert type(reference) is type(original) and reference.tobytes() == original.tobytes()
    else:
        assert type(reference) is type(original) and reference == original


def _frame_params(tmp_path: pathlib.Path, text: str) -> dict:
    """The frame read path: the text as a V2V4Real CAV's frame yaml, read by read_v2v4real_frame."""
    (tmp_path / "000000.yaml").write_text(text)
    frame = read_v2v4real_frame(CavRecord("0", tmp_path, ("000000",)), "000000", True)
    assert frame.lidar_pose.dtype == np.float64 and frame.lidar_pose.shape == (4, 4)
    return frame.params


def _check_every_route(text: str, tmp_path: pathlib.Path):
    """The unsafe loader's value, after checking that the loader, fast_yaml's own route (not its hand-back to the
    loader) and the frame read path build the same."""
    reference = yaml.load(text, Loader=yaml.Loader)
    expected = _typed(reference)
    assert _typed(yaml.load(text, Loader=V2V4RealYamlLoader)) == expected
    assert _typed(fast_yaml.load(text.encode(), V2V4RealYamlLoader)) == expected
    assert _typed(_frame_params(tmp_path, text)) == expected
    return reference


# ------------------------------------------------------------------------------------------------ round trip


def test_the_dumps_hold_what_the_test_says():
    """The facts the table rests on: a numpy scalar dumps as a sequence, _Reduced's state makes the mapping form,
    an ndarray and a dtype always dump as mappings; yaml.dump anchors a dtype shared by several values."""
    text = yaml.dump({"a": np.float64(1.5), "b": _Reduced((SCALAR, (np.dtype("f8"), b"\0" * 8), ())),
                      "c": np.zeros(2), "d": np.dtype("f4")})
    assert "a: !!python/object/apply:numpy._core.multiarray.scalar\n- &id001 !!python/object/apply:numpy.dtype\n" \
        in text
    assert "b: !!python/object/apply:numpy._core.multiarray.scalar\n  args:\n  - *id001\n" in text
    assert "\n  state: !!python/tuple []\nc: !!python/object/apply:numpy._core.multiarray._reconstruct\n  args:\n" \
        in text
    assert "d: !!python/object/apply:numpy.dtype\n  args:\n  - f4\n" in text


@pytest.mark.parametrize("flow, sort", STYLES)
def test_every_numpy_value_reads_as_the_unsafe_loader_reads_it(flow, sort, tmp_path):
    text = yaml.dump(TABLE, default_flow_style=flow, sort_keys=sort)
    variants = _variants(text) if sort else {"numpy 2": text}  # (the substitutions meet no key order: time saved)
    for name, variant in variants.items():
        reference = _check_every_route(variant, tmp_path)
        _holds(reference, TABLE)


def test_each_key_dumped_alone_takes_the_key_route_where_it_can(tmp_path):
    """Each top-level array and dtype dumped alone, the dumps joined: without an anchor (yaml.dump anchors an object
    met twice, such as a dtype), fast_yaml's block route splits the document by key, and V2V4Real's key route reads
    every native-order float or integer array of one or more dimensions and some bytes; the rest goes to the node
    route. Both give the unsafe loader's value."""
    parts = [yaml.dump({key: value}) for key, value in TABLE.items() if isinstance(value, (np.ndarray, np.dtype))]
    assert not any("&" in part for part in parts)
    text = "".join(parts)
    arrays = {key for key, value in TABLE.items() if isinstance(value, np.ndarray)}
    routable = {key for key in arrays if TABLE[key].dtype.str[0] == "<" and TABLE[key].dtype.kind in "fiu"
                and TABLE[key].ndim and TABLE[key].size}
    # 7 of the 10 shapes (not 0-d, not empty) of each multi-byte float or integer dtype, and the pose
    assert len(routable) == 7 * sum(np.dtype(code).kind in "fiu" for code in MULTI_BYTE_CODES) + 1
    for name, variant in _variants(text).items():
        reference = _check_every_route(variant, tmp_path)
        _holds(reference, {key: value for key, value in TABLE.items() if isinstance(value, (np.ndarray, np.dtype))})
        taken = {}
        for part in fast_yaml._top_level_parts(variant):
            route = dumped_ndarray_key(part)
            if route is not None:
                taken[route[0]] = route[1]
        assert set(taken) == (routable if name != "older numpy flags" else set()), name
        for key, array in taken.items():
            assert _typed(array) == _typed(reference[key]), (name, key)


def test_big_endian_arrays_come_back_as_numpy_unpickles_them():
    """ndarray.__setstate__, which the unsafe loader calls, gives numpy 2's arrays native byte order; the values
    are the same. A dtype itself keeps its order."""
    text = yaml.dump({"a": np.arange(3, dtype=">f8"), "d": np.dtype(">i4")})
    reference = yaml.load(text, Loader=yaml.Loader)
    ours = yaml.load(text, Loader=V2V4RealYamlLoader)
    assert ours["a"].dtype == reference["a"].dtype and ours["a"].tolist() == [0.0, 1.0, 2.0]
    assert ours["d"].str == reference["d"].str == ">i4"


# --------------------------------------------------------------------------------------------------- refused


def _mkdir(marker: pathlib.Path) -> _Reduced:
    """A value the unsafe loader builds by calling os.mkdir(marker)."""
    return _Reduced((os.mkdir, (str(marker),)))


# name -> (the value dumped at key gps, the refused tag, what the error line says besides, whether loading it with
# the unsafe loader runs the call)
REFUSED = {
    "a call": (_mkdir, "python/object/apply:posix.mkdir", "could not determine a constructor", True),
    "an object-dtype array holding a call": (lambda marker: np.array([_mkdir(marker), 1], dtype=object),
                                             "python/object/apply:numpy.dtype", "'O8'", True),
    "an object-dtype scalar holding a call": (lambda marker: _Reduced((SCALAR, (np.dtype(object), _mkdir(marker)))),
                                              "python/object/apply:numpy.dtype", "'O8'", True),
    "a python name": (lambda marker: os.mkdir, "python/name:posix.mkdir", "could not determine", False),
    "a python object": (lambda marker: _Reduced((copyreg.__newobj__, (pathlib.PurePosixPath, str(marker)))),
                        "python/object/new:pathlib", "could not determine", False),
    "an ndarray subclass (np.matrix)": (lambda marker: np.matrix([[1.0, 2.0]]),
                                        "python/object/apply:numpy._core.multiarray._reconstruct",
                                        "numpy.ndarray", False),
    "a masked array": (lambda marker: np.ma.masked_array([1.0], mask=[False]), "python/object/apply:numpy.ma",
                       "could not determine", False),
    "a string array": (lambda marker: np.array(["ab"]), "python/object/apply:numpy.dtype", "'U2'", False),
    "a structured array": (lambda marker: np.zeros(2, dtype=[("x", "f4")]), "python/object/apply:numpy.dtype",
                           "'V4'", False),
    "a datetime scalar": (lambda marker: np.datetime64("2020-01-01"), "python/object/apply:numpy.dtype", "'M8'",
                          False),
}


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_any_other_object_is_one_error_line_and_never_runs(name, tmp_path):
    make, tag, says, runs = REFUSED[name]
    if runs:  # the payload is live: the unsafe loader makes its directory
        live = tmp_path / "live"
        try:
            yaml.load(yaml.dump({"gps": make(live)}), Loader=yaml.Loader)
        except (TypeError, ValueError):
            pass  # numpy refuses what the call returned, after the call
        assert live.is_dir()
    marker = tmp_path / "ran"
    text = yaml.dump({"ego_speed": 1.5, "gps": make(marker), "lidar_pose": np.eye(4)})
    line = next(number for number, content in enumerate(text.splitlines(), 1) if tag in content)
    path = tmp_path / "000000.yaml"
    path.write_text(text)
    for read in (lambda: load_opv2v_yaml(path, V2V4RealYamlLoader),
                 lambda: read_v2v4real_frame(CavRecord("0", tmp_path, ("000000",)), "000000", True)):
        with pytest.raises(DataError) as error:
            read()
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{path}: unsupported YAML tag"), message
        assert tag in message and f"at line {line}," in message and says in message, message
    assert not marker.exists()


@pytest.mark.parametrize("name, edit", [
    ("bytes one short", lambda text: text.replace("AAAAAAAA+D8=", "AAAAAAAA+A==")),
    ("a byte order a dump never writes", lambda text: text.replace("    - <\n", "    - '|'\n", 1)),
    ("_reconstruct's args changed", lambda text: text.replace("    - 0\n  - !!binary |\n    Yg==",
                                                              "    - 1\n  - !!binary |\n    Yg==")),
    ("a scalar with a state", lambda text: text.replace("  state: !!python/tuple []", "  state: [1]")),
    ("a scalar with listitems", lambda text: text.replace("  state: !!python/tuple []", "  listitems: [1]")),
    ("an unknown key", lambda text: text.replace("  state: !!python/tuple []", "  other: 1")),
    ("70 dimensions", lambda text: text.replace("    - 0\n    - 2\n", "    - 0\n" + "    - 1\n" * 69)),
    ("a size past numpy's index range",
     lambda text: text.replace("    - 0\n    - 2\n", "    - 0\n" + "    - 1099511627776\n" * 2)),
])
def test_a_damaged_numpy_object_is_one_error_line(name, edit, tmp_path):
    """Hand-edited forms no dump writes (the unsafe loader may build something from some): refused, one line."""
    text = yaml.dump({"a": np.ones(1), "e": np.zeros((0, 2)),
                      "s": _Reduced((SCALAR, (np.dtype("f8"), np.float64(1.5).tobytes()), ()))})
    damaged = edit(text)
    assert damaged != text
    path = tmp_path / "000000.yaml"
    path.write_text(damaged)
    with pytest.raises(DataError) as error:
        load_opv2v_yaml(path, V2V4RealYamlLoader)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"{path}: unsupported YAML tag (!!python/")


@pytest.mark.parametrize("speed", [np.float32(31.25), np.float64(31.25), np.int64(31), 31, 31.25])
def test_a_numpy_ego_speed_is_a_number(speed):
    """A frame whose ego_speed yaml.dump wrote as a numpy scalar reads as that number (V2X-ViT's prior reads it)."""
    from opencood_ddp.data.opv2v import ego_speed_of

    text = yaml.dump({"ego_speed": speed})
    assert ego_speed_of(yaml.load(text, Loader=V2V4RealYamlLoader), "f.yaml") == float(speed)


@pytest.mark.parametrize("speed", [True, np.bool_(True), "31"])
def test_an_ego_speed_that_is_no_number_is_refused(speed):
    from opencood_ddp.data.opv2v import ego_speed_of
    from opencood_ddp.errors import DataError

    with pytest.raises(DataError, match="'ego_speed' must be a number"):
        ego_speed_of({"ego_speed": speed}, "f.yaml")
