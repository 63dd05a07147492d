"""V2V4Real: two real cars, OPV2V's folders, (4, 4) poses and labels in each car's own LiDAR frame.

Layout (``{train,validate,test}/testoutput_CAV_data_<date>_<k>/<cav>/<timestamp>.{yaml,pcd}``, CAVs ``0`` and ``1``)
is scanned by ``data/opv2v.py``: scenes, CAVs and timestamps sorted as strings, the first CAV the ego. The rules
below are V2V4Real's own OpenCOOD fork's (ucla-mobility/V2V4Real; facts: tests/reference/DATASET_FACTS.md
section 2), with the departures named in docs/compatibility.md:

- ``lidar_pose`` is a (4, 4) LiDAR-to-world matrix. The fork's files hold it as a numpy array (and other values,
  such as ``gps``, as numpy scalars), which upstream reads with PyYAML's unsafe loader. Here a safe loader builds
  what that loader builds from what ``yaml.dump`` writes for numpy objects of a number type (bool, int, uint,
  float, complex; any byte order): ndarrays of any shape, C or Fortran order (``numpy.core.multiarray.
  _reconstruct`` or numpy 2's ``numpy._core``, args naming exactly ``numpy.ndarray``), scalars (``.multiarray.
  scalar``, as a sequence or a mapping of args) and dtypes (``numpy.dtype``), anywhere in the document. Each part is
  checked against what numpy writes, the bytes against shape x item size, and no tag's name is imported. Any other
  Python tag (another name or object, an object, structured, string or datetime dtype) is one error line naming
  the yaml, the line and the tag; so is a pose that is not a 4x4 matrix (a numpy array or a plain nested list).
- ``vehicles`` are given in the CAV's own LiDAR frame: an object's pose is [location + center, angle] (degrees),
  mapped by ``T_target<-cav @ pose_to_matrix(object pose)``. ``obj_type`` Pedestrian is dropped and every other
  class is one vehicle class; an object's id is its ``ass_id`` (the association across the two cars) unless that
  is -1, then ``object_id + 100 * cav_id``. A box is kept when at least 2 of its corners lie in the range
  (``min_corners``), in training (cav_lidar_range) and at test (the GT range); intermediate fusion re-filters the
  sample's boxes to cav_lidar_range with the same rule (``refilters_each_cav``).
- Timestamps skip yaml names holding ``additional`` or ``camera_gt``. The test-time GT range is the fork's
  GT_RANGE [-100, -40, -5, 100, 40, 3] unless ``postprocess.gt_range`` says otherwise.
- Communication range: 70 m, tested by intermediate fusion only (the fork's early and late datasets take both
  cars whatever their distance).
- In training the fork shuffles each scene's CAV list once, so either car may be the ego; here the order is drawn
  once per scene from the dataset's seed (the fork's draw is per process, so ranks disagree). At test the first
  CAV (``0``) is the ego.
- Delay and localisation error (``wild_setting``, ``noise_setting``) work on the matrices (``wild.perturb``):
  the fork's ``add_loc_noise`` fails on them (its issue 39). The ground truth is placed with the true current
  poses, also under delay or noise; the fork places each car's current labels with the delayed, noisy transform
  its points travel with (its ``reform_param``), and ``fusion.args.gt_transform: as_received`` does the same in
  early and intermediate fusion, so that its Async column can be compared.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import re
import reprlib
from typing import Any, Dict, Mapping, NoReturn, Optional, Sequence, Tuple

import numpy as np
import yaml

from opencood_ddp.data.geometry import project_local_objects, x1_to_x2
from opencood_ddp.data.opv2v import (CavFrame, CavRecord, Opv2vIndex, Opv2vYamlLoader, Scenario,
                                     check_cav_timestamps, checked_pose, load_opv2v_yaml)
from opencood_ddp.data.sources import Objects
from opencood_ddp.data.sources.opv2v import Opv2vSource, boxes_and_ids, vehicles_of
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.hypes import get_key
from opencood_ddp.registry import SOURCES

V2V4REAL_COMM_RANGE = 70.0  # metres: the fork's COM_RANGE, tested by its intermediate dataset only
# The fork's GT_RANGE: its test-time ground truth and detections, where the hypes set no postprocess.gt_range.
V2V4REAL_GT_RANGE = (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0)
MIN_CORNERS = 2  # the fork's mask_boxes_outside_range_numpy default
ID_STRIDE_PER_CAV = 100  # an unassociated object's id: object_id + 100 * cav_id
# Early and intermediate fusion's ground truth under delay or localisation error: each car's current labels mapped
# with its current true pose (ours, the default), or with the delayed, noisy transform its points travel with (the
# fork's reform_param: its README's Async column was measured so).
GT_TRANSFORM_KEY = "fusion.args.gt_transform"
GT_TRANSFORMS = ("true_poses", "as_received")
DROPPED_CLASS = "Pedestrian"  # the fork's only skipped class; every other one is a vehicle
TRAIN_ORDER_DRAWS = 11  # the last word of the generator key that orders a scene's CAVs in training

# ------------------------------------------------------------------------------------------------- YAML
# PyYAML's unsafe Dumper writes a numpy object as the call its pickle reduce names (Representer.represent_object):
# the call's args as a sequence where the reduce carries nothing else (a scalar), else a mapping of args and state
# (an ndarray, a dtype). The three calls are rebuilt here from their checked parts, never by importing a tag's
# name, and only for plain number dtypes: an object dtype's data is a pickle, which runs code when loaded.
_TAG = "tag:yaml.org,2002:"
_DTYPE_TAG = _TAG + "python/object/apply:numpy.dtype"
_NDARRAY_NAME_TAG = _TAG + "python/name:numpy.ndarray"
_MULTIARRAY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")  # written under numpy 1 and numpy 2
_NUMBER_KINDS = "biufc"  # bool, int, uint, float, complex
_NUMBER_CODE = re.compile(r"[biufc][1-9][0-9]?")  # a number dtype's code without its byte order: b1, i8, f16, c32
_APPLY_KEYS = ("args", "kwds", "state", "listitems", "dictitems")  # the keys of represent_object's mapping form
_RECONSTRUCT_ARGS = ((0,), b"b")  # after numpy.ndarray: the empty array that ndarray.__reduce__'s state fills


class V2V4RealYamlLoader(Opv2vYamlLoader):
    """OPV2V's safe loader plus the Python objects V2V4Real's frame files hold: numpy arrays, scalars and dtypes of
    plain number types, built as PyYAML's unsafe loader builds them from ``yaml.dump``'s text (module docstring)."""

    READS = ("only plain YAML, !!python/tuple and numpy's scalars, arrays and dtypes of number types (as yaml.dump "
             "writes them) are read")


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


def _number_dtype(args: tuple, state: Any) -> Optional[np.dtype]:
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
    dtype = _number_dtype(args, state)
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


def _ndarray(shape: tuple, dtype: np.dtype, fortran: bool, data: bytes) -> Optional[np.ndarray]:
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


def _state_problem(shape: Any, dtype: Any, fortran: Any, data: Any) -> Optional[str]:
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
    problem = _state_problem(*state[1:])
    array = None if problem else _ndarray(*state[1:])
    if array is None:
        _refuse(node, problem or f"numpy cannot make an array of shape {reprlib.repr(state[1])}")
    return array


V2V4RealYamlLoader.add_constructor(_DTYPE_TAG, _construct_dtype)
for _module in _MULTIARRAY_MODULES:
    V2V4RealYamlLoader.add_constructor(f"{_TAG}python/object/apply:{_module}._reconstruct", _construct_ndarray)
    V2V4RealYamlLoader.add_constructor(f"{_TAG}python/object/apply:{_module}.scalar", _construct_scalar)


# A top-level key holding an ndarray exactly as PyYAML's dump writes one (numpy 1 or 2, block style, a shape
# of one or more dimensions, a little-endian number dtype, the bytes in one literal block). The parts that
# carry no data (``args``, the pickle and dtype versions, the dtype's flags) are matched only in the form dump
# gives them, so that the text means nothing else and the same checks as the constructor's pass; any other form
# is the node route's (dump quotes a big-endian '>' and a single byte's '|', which plain would start a block
# scalar).
_BASE64_LINES = r"(?:    [A-Za-z0-9+/=]+\n)+"
_DUMPED_NDARRAY = re.compile(
    r"(?P<key>[A-Za-z_][A-Za-z0-9_]*): !!python/object/apply:numpy\.(?:core|_core)\.multiarray\._reconstruct\n"
    r"  args:\n  - !!python/name:numpy\.ndarray ''\n  - !!python/tuple\n    - 0\n  - !!binary \|\n    Yg==\n"
    r"  state: !!python/tuple\n  - 1\n  - !!python/tuple\n(?P<shape>(?:    - (?:0|[1-9][0-9]*)\n)+)"
    r"  - !!python/object/apply:numpy\.dtype\n    args:\n    - (?P<code>[fiu][1-9][0-9]*)\n    - false\n    - true\n"
    r"    state: !!python/tuple\n    - 3\n    - (?P<order><)\n    - null\n    - null\n    - null\n"
    r"    - -1\n    - -1\n    - 0\n"
    r"  - (?P<fortran>false|true)\n  - !!binary \|\n(?P<data>" + _BASE64_LINES + r")\Z")


def dumped_ndarray_key(part: str) -> Optional[Tuple[str, np.ndarray]]:
    """fast_yaml's key route for a frame's numpy pose: (key, array) where ``part`` is one top-level key's text
    in _DUMPED_NDARRAY's form, the value _construct_ndarray builds from it; None for anything else, so that
    the node route builds it (or gives the loader's error)."""
    match = _DUMPED_NDARRAY.match(part)
    if match is None:
        return None
    try:
        # The literal block's value, as the loader's construct_yaml_binary decodes it: each line without its
        # indentation, then a newline.
        text = "".join(line[4:] + "\n" for line in match["data"].splitlines())
        data = base64.decodebytes(text.encode("ascii"))
    except (ValueError, binascii.Error):
        return None
    dtype = _number_dtype((match["code"], False, True), (3, match["order"], None, None, None, -1, -1, 0))
    shape = tuple(int(line[6:]) for line in match["shape"].splitlines())
    if dtype is None or _state_problem(shape, dtype, match["fortran"] == "true", data):
        return None
    array = _ndarray(shape, dtype, match["fortran"] == "true", data)
    return None if array is None else (match["key"], array)


V2V4RealYamlLoader.fast_yaml_key_routes = (dumped_ndarray_key,)


def pose_matrix_of(params: Mapping[str, Any], path: Any) -> np.ndarray:
    """The frame's ``lidar_pose`` as a float64 (4, 4) matrix; one DataError line naming ``path`` otherwise."""
    return checked_pose(params, path, (4, 4), "a 4x4 LiDAR-to-world matrix (V2V4Real)",
                        "this is not a V2V4Real frame as it should be: re-export it, or set fusion.dataset to the "
                        "data set it belongs to")


def read_v2v4real_frame(cav: CavRecord, timestamp: str, ego: bool) -> CavFrame:
    """One car's frame: its yaml parsed once (safely), its (4, 4) pose."""
    path = cav.yaml_path(timestamp)
    params = load_opv2v_yaml(path, V2V4RealYamlLoader)
    return CavFrame(cav.cav_id, params, pose_matrix_of(params, path), cav.pcd_path(timestamp), path, ego,
                    float("nan"))


# ------------------------------------------------------------------------------------------------ source


def _check_hypes(hypes: Mapping, source: str) -> None:
    mode = get_key(hypes, GT_TRANSFORM_KEY, GT_TRANSFORMS[0])
    if mode not in GT_TRANSFORMS:
        raise ConfigError(f"{source}: key {GT_TRANSFORM_KEY} must be one of {', '.join(GT_TRANSFORMS)}, got "
                          f"{mode!r}; fix the hypes ({GT_TRANSFORMS[1]} reproduces the fork's Async ground truth)")


@SOURCES.register("v2v4real", gt_range=V2V4REAL_GT_RANGE, optional=((GT_TRANSFORM_KEY, "str"),), check=_check_hypes)
class V2V4RealSource(Opv2vSource):
    """A V2V4Real split folder, read with its fork's rules (module docstring)."""

    min_corners = MIN_CORNERS
    refilters_each_cav = True
    read_frame = staticmethod(read_v2v4real_frame)
    not_frames = ("additional", "camera_gt")  # the fork skips both kinds of yaml

    def __init__(self, hypes: Mapping, split_key: str, *, train: bool, seed: int, max_cav: int):
        super().__init__(hypes, split_key, train=train, seed=seed, max_cav=max_cav)
        self.labels_follow_points = get_key(hypes, GT_TRANSFORM_KEY, GT_TRANSFORMS[0]) == GT_TRANSFORMS[1]

    def scan(self, folder: Any, split_key: str) -> Opv2vIndex:
        index = dataclasses.replace(super().scan(folder, split_key), comm_range=V2V4REAL_COMM_RANGE)
        if not self.train:
            return index
        scenes = tuple(self.training_order(k, scene) for k, scene in enumerate(index.scenarios))
        return dataclasses.replace(index, scenarios=scenes)

    def training_order(self, number: int, scene: Scenario) -> Scenario:
        """The scene with its CAVs in the order drawn for training (the first is the ego), the same on every rank
        and epoch: a generator keyed by the seed and the scene's number."""
        order = np.random.default_rng([self.seed, number, TRAIN_ORDER_DRAWS]).permutation(len(scene.cavs))
        cavs = tuple(scene.cavs[i] for i in order)
        for cav in cavs[1:]:  # the new ego's timestamps are the scene's: every other car must have them
            check_cav_timestamps(cavs[0], cav)
        return dataclasses.replace(scene, cavs=cavs)

    def comm_range(self, fusion: str) -> Optional[float]:
        return self.index.comm_range if fusion == "intermediate" else None

    def objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The car's labels (its own LiDAR frame) in the frame of ``target_pose``, kept with 2 corners in range; ids
        from ``ass_id``, else ``object_id + 100 * cav_id``."""
        return self.objects_through(frame, x1_to_x2(frame.lidar_pose, target_pose), gt_range)

    def objects_through(self, frame: CavFrame, transform: np.ndarray, gt_range: Sequence[float]) -> Objects:
        vehicles = {object_id: content for object_id, content in vehicles_of(frame).items()
                    if not (isinstance(content, Mapping) and content.get("obj_type", "Car") == DROPPED_CLASS)}
        projected = project_local_objects(vehicles, transform, gt_range, self.order,
                                          source=str(frame.meta_path), min_corners=self.min_corners)
        boxes, object_ids = boxes_and_ids(projected)
        return boxes, [self.object_id(object_id, vehicles[object_id], frame) for object_id in object_ids]

    @staticmethod
    def object_id(object_id: Any, content: Mapping[str, Any], frame: CavFrame) -> Any:
        """The fork's id rule: ``ass_id`` (default: the object id) unless -1, then ``object_id + 100 * cav_id``."""
        association = content.get("ass_id", object_id)
        if association != -1:
            return association
        try:
            return int(object_id) + ID_STRIDE_PER_CAV * int(frame.cav_id)
        except ValueError:
            raise DataError(f"{frame.meta_path}: object {object_id!r} has ass_id -1, so its id is object_id + 100 "
                            f"* cav_id, which needs integer ids and CAV folder {frame.cav_id!r}; rename the CAV "
                            f"folders 0 and 1 as V2V4Real does") from None


__all__ = ["GT_TRANSFORMS", "GT_TRANSFORM_KEY", "V2V4REAL_GT_RANGE", "V2V4RealSource", "V2V4RealYamlLoader",
           "pose_matrix_of", "read_v2v4real_frame"]
