"""V2V4Real: two real cars, OPV2V's folders, (4, 4) poses and labels in each car's own LiDAR frame.

Layout (``{train,validate,test}/testoutput_CAV_data_<date>_<k>/<cav>/<timestamp>.{yaml,pcd}``, CAVs ``0`` and ``1``)
is scanned by ``data/opv2v.py``: scenes, CAVs and timestamps sorted as strings, the first CAV the ego. The rules
below are V2V4Real's own OpenCOOD fork's (ucla-mobility/V2V4Real; facts: tests/reference/DATASET_FACTS.md
section 2), with the departures named in docs/compatibility.md:

- ``lidar_pose`` is a (4, 4) LiDAR-to-world matrix. The fork's files hold it as a numpy array (and other values,
  such as ``gps``, as numpy scalars), which upstream reads with PyYAML's unsafe loader. Here a safe loader builds
  what that loader builds from what ``yaml.dump`` writes for numpy objects of a number type (``numpy_yaml.py``),
  and no tag's name is imported. Any other Python tag (another name or object, an object, structured, string or
  datetime dtype) is one error line naming the yaml, the line and the tag; so is a pose that is not a 4x4 matrix
  (a numpy array or a plain nested list).
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
import re
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

from opencood_ddp.data.geometry import project_local_objects, x1_to_x2
from opencood_ddp.data.opv2v import (CavFrame, CavRecord, Opv2vIndex, Opv2vYamlLoader, Scenario,
                                     check_cav_timestamps, checked_pose, load_opv2v_yaml)
from opencood_ddp.data.sources import Objects
from opencood_ddp.data.sources.opv2v import Opv2vSource, boxes_and_ids, vehicles_of
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.hypes import get_key
from opencood_ddp.numpy_yaml import (add_numpy_constructors, ndarray_from_state, number_dtype,
                                      state_problem)
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
class V2V4RealYamlLoader(Opv2vYamlLoader):
    """OPV2V's safe loader plus the Python objects V2V4Real's frame files hold: numpy arrays, scalars and dtypes of
    plain number types, built as PyYAML's unsafe loader builds them from ``yaml.dump``'s text (module docstring)."""

    READS = ("only plain YAML, !!python/tuple and numpy's scalars, arrays and dtypes of number types (as yaml.dump "
             "writes them) are read")


add_numpy_constructors(V2V4RealYamlLoader)


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
    dtype = number_dtype((match["code"], False, True), (3, match["order"], None, None, None, -1, -1, 0))
    shape = tuple(int(line[6:]) for line in match["shape"].splitlines())
    if dtype is None or state_problem(shape, dtype, match["fortran"] == "true", data):
        return None
    array = ndarray_from_state(shape, dtype, match["fortran"] == "true", data)
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
