"""numpy's number objects in YAML, as PyYAML's ``yaml.dump`` writes them, read without running code.

PyYAML's default Dumper writes a numpy value as the call its pickle reduce names. Such text reaches us from tools that
dump numpy values: V2V4Real's frame files (a (4, 4) ``lidar_pose`` array, numpy scalars) and every run folder of
upstream OpenCOOD, whose train.py dumps the hypes after its yaml_parser has put a numpy array in them
(``model.args.point_pillar_scatter.grid_size``, SECOND's ``model.args.grid_size``). Upstream reads both back with
PyYAML's unsafe loader, which imports and calls whatever a tag names. ``add_numpy_constructors`` gives a safe loader
what that loader builds for numpy objects of a number type (bool, int, uint, float, complex; any byte order):
ndarrays of any shape, C or Fortran order (``numpy.core.multiarray._reconstruct`` or numpy 2's ``numpy._core``,
args naming exactly ``numpy.ndarray``), scalars (``.multiarray.scalar``, as a sequence or a mapping of args) and
dtypes (``numpy.dtype``), anywhere in the document, plus ``!!python/tuple``. Each part is checked against what numpy
writes, the bytes against shape x item size, and no tag's name is imported; any other Python tag stays the loader's
ConstructorError.
"""
from __future__ import annotations

import math
import re
import reprlib
from typing import Any, Callable, Dict, Mapping, NoReturn, Optional, Tuple

import numpy as np
import yaml

# PyYAML's unsafe Dumper writes a numpy object as the call its pickle reduce names (Representer.represent_object):
# the call's args as a sequence where the reduce carries nothing else (a scalar), else a mapping of args and state
# (an ndarray, a dtype). The three calls are rebuilt here from their checked parts, never by importing a tag's
# name, and only for plain number dtypes: an object dtype's data is a pickle, which runs code when loaded.
_TAG = "tag:yaml.org,2002:"
_DTYPE_TAG = _TAG + "python/object/apply:numpy.dtype"
TUPLE_TAG = _TAG + "python/tuple"
_NDARRAY_NAME_TAG = _TAG + "python/name:numpy.ndarray"
_MULTIARRAY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # written under numpy 1 and numpy 2
_NUMBER_KINDS = "biufc"  # bool, int, uint, float, complex
_NUMBER_CODE = re.compile(r"[biufc][1-9][0-9]?")  # a number dtype's code without its byte order: b1, i8, f16, c32
_APPLY_KEYS = ("args", "kwds", "state", "listitems", "dictitems")  # the keys of represent_object's mapping form
_RECONSTRUCT_ARGS = ((0,), b"b")  # after numpy.ndarray: the empty array that ndarray.__reduce__'s state fills


def _refuse(node: yaml.Node, why: str) -> NoReturn:
    tag = node.tag.replace(_TAG, "!!", 1)  # as the file writes it
    raise yaml.constructor.ConstructorError(None, None, f"{tag}: {why}", node.start_mark)


def _built(loader: yaml.BaseLoader, node: yaml.Node) -> Any:
    return loader.construct_object(node, deep=True)


def _is_nothing(value: Any) -> bool:
    """Whether the unsafe loader's ``if state:`` (``if listitems:`` ...) skips ``value``: None or a false plain value.
    (type(), not isinstance: a numpy value has no plain truth here.)"""
    return value is None or (type(value) in (bool, int, float, str, bytes, tuple, list, dict, set) and not value)


def _apply_parts(loader: yaml.BaseLoader, node: yaml.Node) -> Tuple[list, Any]:
    """(the args' nodes, the built state or None) of a ``!!python/object/apply`` node in either of represent_object's
    forms: a sequence of args, or a mapping of args and state. Its kwds, listitems and dictitems must be empty: the
    unsafe loader would pass or apply them."""
    if isinstance(node, yaml.SequenceNode):
        return node.value, None
    if not isinstance(node, yaml.MappingNode):
        _refuse(node, "expected a sequence of args or a mapping of args and state")
    parts: Dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        key = _built(loader, key_node)
        if type(key) is not str or key not in _APPLY_KEYS:
            _refuse(node, f"unexpected key {reprlib.repr(key)} (expected {', '.join(_APPLY_KEYS)})")
        parts[key] = value_node
    if not isinstance(parts.get("args"), yaml.SequenceNode):
        _refuse(node, "its args must be a sequence")
    kwds = _built(loader, parts["kwds"]) if "kwds" in parts else {}
    if type(kwds) is not dict or kwds:  # the unsafe loader calls function(*args, **kwds)
        _refuse(node, "its kwds must be an empty mapping")
    for key in ("listitems", "dictitems"):  # applied where true
        if key in parts and not _is_nothing(_built(loader, parts[key])):
            _refuse(node, f"its {key} must be empty")
    return parts["args"].value, _built(loader, parts["state"]) if "state" in parts else None


def number_dtype(args: tuple, state: Any) -> Optional[np.dtype]:
    """The dtype ``numpy.dtype(*args)`` then ``__setstate__(state)`` makes, where it is a plain number type and
    (args, state) are what numpy's own ``dtype.__reduce__`` gives for it; else None. Types are checked first, so
    that no comparison below meets a numpy value."""
    if not (len(args) == 3 and type(args[0]) is str and _NUMBER_CODE.fullmatch(args[0])
            and all(type(flag) in (bool, int) for flag in args[1:])):  # older numpy wrote align, copy as 0, 1
        return None
    if not (type(state) is tuple and len(state) == 8 and all(type(item) in (int, str, type(None)) for item in state)
            and state[1] in ("<", ">", "|")):
        return None
    try:
        dtype = np.dtype(state[1] + args[0])
    except TypeError:  # a code this platform has no type for (f16 where long double is 8 bytes)
        return None
    return dtype if dtype.kind in _NUMBER_KINDS and dtype.__reduce__()[1:] == (args, state) else None


def _construct_dtype(loader: yaml.BaseLoader, node: yaml.Node) -> np.dtype:
    """``numpy.dtype``: args (code, align, copy), state (3, byte order, None, None, None, -1, -1, 0)."""
    arg_nodes, state = _apply_parts(loader, node)
    args = tuple(_built(loader, item) for item in arg_nodes)
    dtype = number_dtype(args, state)
    if dtype is None:
        _refuse(node, f"args {reprlib.repr(args)} and state {reprlib.repr(state)} are not a plain number dtype as "
                      f"numpy writes one; only bool, int, uint, float and complex dtypes are read")
    return dtype


def _dtype_arg(loader: yaml.BaseLoader, owner: yaml.Node, node: yaml.Node) -> np.dtype:
    if node.tag != _DTYPE_TAG:
        _refuse(owner, f"expected a !!python/object/apply:numpy.dtype, found {node.tag.replace(_TAG, '!!', 1)}")
    return _built(loader, node)


def _construct_scalar(loader: yaml.BaseLoader, node: yaml.Node) -> np.generic:
    """``numpy.(_)core.multiarray.scalar``: args (dtype, raw bytes) -> the numpy scalar (native byte order, as
    numpy's scalar() makes it), in the sequence form ``yaml.dump`` writes or the mapping form with args."""
    arg_nodes, state = _apply_parts(loader, node)
    if not _is_nothing(state):
        _refuse(node, "a numpy scalar has no state")
    if len(arg_nodes) != 2:
        _refuse(node, f"expected args (dtype, bytes), found {len(arg_nodes)} items")
    dtype = _dtype_arg(loader, node, arg_nodes[0])
    data = _built(loader, arg_nodes[1])
    if type(data) is not bytes or len(data) != dtype.itemsize:
        _refuse(node, f"a {dtype} scalar needs {dtype.itemsize} bytes of !!binary, found {reprlib.repr(data)}")
    return np.frombuffer(data, dtype=dtype)[0]


def ndarray_from_state(shape: tuple, dtype: np.dtype, fortran: bool, data: bytes) -> Optional[np.ndarray]:
    """What ``ndarray.__setstate__`` (numpy's own unpickling, as the unsafe loader calls it) makes of a checked state:
    an array owning a copy of ``data``; numpy 2 turns a non-native byte order native. None where numpy cannot make
    an array of that shape."""
    try:
        # ndarray's own checks of a shape first (at most 64 dimensions, a size in its index range, even with a 0 in
        # the shape): __setstate__ alone misreads a shape of over 64 dimensions and takes sizes ndarray refuses.
        np.ndarray(shape, dtype, buffer=data, order="F" if fortran else "C")
    except ValueError:
        return None
    array = np.ndarray((0,), dtype="b")
    array.__setstate__((1, shape, dtype, fortran, data))
    return array


def state_problem(shape: Any, dtype: Any, fortran: Any, data: Any) -> Optional[str]:
    """Why (shape, dtype, fortran order, bytes) are not a number array's pickled state; None where they are."""
    if type(shape) is not tuple or not all(type(size) is int and size >= 0 for size in shape):
        return f"the shape must be a tuple of sizes, found {reprlib.repr(shape)}"
    if not isinstance(dtype, np.dtype) or dtype.kind not in _NUMBER_KINDS:  # only _construct_dtype makes one
        return f"expected a number dtype, found {reprlib.repr(dtype)}"
    if type(fortran) is not bool:
        return f"the Fortran order flag must be true or false, found {reprlib.repr(fortran)}"
    if type(data) is not bytes or len(data) != dtype.itemsize * math.prod(shape):
        return (f"an array of shape {reprlib.repr(shape)} and {dtype} needs {dtype.itemsize * math.prod(shape)} "
                f"bytes of !!binary, found {len(data) if type(data) is bytes else reprlib.repr(data)}")
    return None


def _construct_ndarray(loader: yaml.BaseLoader, node: yaml.Node) -> np.ndarray:
    """``numpy.(_)core.multiarray._reconstruct``: args (numpy.ndarray, (0,), b'b') make an empty array that
    ``__setstate__`` fills from state (1, shape, dtype, Fortran order, raw bytes)."""
    arg_nodes, state = _apply_parts(loader, node)
    name = arg_nodes[0] if arg_nodes else None
    if not (isinstance(name, yaml.ScalarNode) and name.tag == _NDARRAY_NAME_TAG and name.value == ""):
        _refuse(node, "its args must start with !!python/name:numpy.ndarray ''")
    rest = tuple(_built(loader, item) for item in arg_nodes[1:])
    if not (len(rest) == 2 and type(rest[0]) is tuple and all(type(size) is int for size in rest[0])
            and type(rest[1]) is bytes and rest == _RECONSTRUCT_ARGS):
        _refuse(node, f"its args after numpy.ndarray must be {_RECONSTRUCT_ARGS}, found {reprlib.repr(rest)}")
    if not (type(state) is tuple and len(state) == 5 and type(state[0]) is int and state[0] == 1):
        _refuse(node, "its state must be (1, shape, dtype, Fortran order, bytes)")
    problem = state_problem(*state[1:])
    array = None if problem else ndarray_from_state(*state[1:])
    if array is None:
        _refuse(node, problem or f"numpy cannot make an array of shape {reprlib.repr(state[1])}")
    return array


def construct_tuple(loader: yaml.BaseLoader, node: yaml.SequenceNode) -> tuple:
    return tuple(loader.construct_sequence(node, deep=True))


def add_numpy_constructors(loader_cls: type) -> None:
    """Register the numpy objects' constructors on ``loader_cls`` (a subclass: PyYAML copies the constructor table
    on a class's first add, so yaml's own loaders stay untouched), with ``!!python/tuple``, which their nodes
    hold (set again on a subclass of OPV2V's frame loader: the same function under the same tag)."""
    loader_cls.add_constructor(TUPLE_TAG, construct_tuple)
    loader_cls.add_constructor(_DTYPE_TAG, _construct_dtype)
    for module in _MULTIARRAY_MODULES:
        loader_cls.add_constructor(f"{_TAG}python/object/apply:{module}._reconstruct", _construct_ndarray)
        loader_cls.add_constructor(f"{_TAG}python/object/apply:{module}.scalar", _construct_scalar)


def plain(value: Any, key: Callable[[Any], Any] = lambda k: k) -> Any:
    """``value`` with its numpy scalars and arrays (anything with ``tolist``, torch's tensors too) and its tuples as
    the plain lists, ints, floats and bools a hypes dictionary holds, at any depth; each mapping key through
    ``key``."""
    if isinstance(value, Mapping):
        return {key(k): plain(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, key) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
