"""Copy a toy OPV2V set into the exact on-disk layout of V2V4Real, as its own OpenCOOD fork reads it.

The facts followed here are those of ``/work/shared/reference/DATASET_FACTS.md`` section 2 (V2V4Real). Layout::

    <out>/toy_manifest.yaml                       what was converted (seed, the source set's identity, summary)
    <out>/{train,validate,test}/testoutput_CAV_data_YYYY-MM-DD-HH-MM-SS_<k>/{0,1}/<timestamp>.pcd
                                                                                /<timestamp>.yaml

- Scenario folders: the toy scenario's date-time name (``2021_08_16_22_26_54`` -> ``2021-08-16-22-26-54``) and
  ``<k>``, the scenario's index within its split in sorted order (0, 1, ...).
- CAV folders: V2V4Real has exactly two vehicles, ``0`` (the ego at evaluation: upstream sorts the CAV list
  there) and ``1``. They are the toy scenario's first two CAV folders in the OPV2V reader's order
  (``order_cav_ids``: string sort, negative ids last); further CAVs and road-side units are dropped.
- Timestamps: 6-digit zero-padded, renumbered ``000000``, ``000001``, ... in the toy's frame order, the same
  list in both CAV folders (upstream takes the list of the first CAV and assumes it for every CAV).
- ``.pcd``: the toy CAV's cloud copied byte for byte. V2V4Real's clouds are read with open3d as OPV2V's are
  (x y z, intensity in the colour channel), and the points already are in the CAV's LiDAR frame.
- ``.yaml`` (keys sorted, as ``yaml.dump`` writes them):

  - ``lidar_pose``: the LiDAR->world 4x4 float64 matrix, not OPV2V's 6-vector. Upstream indexes it as an
    ndarray (``pose[0, -1]``) after loading with PyYAML's unsafe loader, so the real files carry the numpy
    object tags PyYAML's default Dumper wrote under numpy 1.x (``numpy.core.multiarray._reconstruct``, the
    raw little-endian bytes as ``!!binary``). The installed numpy 2 would write ``numpy._core``; this module
    builds the numpy 1.x nodes itself (``_V2V4RealDumper``), and nothing here ever loads them back.
  - ``ego_speed``: the toy's value (km/h).
  - ``vehicles``: ``{object_id: {angle, ass_id, center, extent, location, obj_type}}`` in the CAV's OWN LiDAR
    frame. Upstream builds the object pose ``[location + center, angle]`` (componentwise sum, degrees), turns
    it into a matrix with ``x_to_world`` (== ``pose_to_matrix``) and maps it to the ego with T_ego<-cav. So each
    toy object (world frame) becomes ``T_local = inv(T_world_lidar) @ pose_to_matrix(world pose)``, written as
    the 6-vector ``matrix_to_pose(T_local)``, split into ``location = position - center`` with
    ``center = [0.05, 0, 0]`` (a non-zero offset, so a reader that ignores ``center`` is caught).
  - Object ids: each CAV numbers its objects 0, 1, 2, ... (vehicles sorted by toy vehicle id, then the
    pedestrians). ``ass_id`` links an object both CAVs list: ``ASS_ID_OFFSET + toy vehicle id``; an object only
    one CAV lists has ``-1`` (upstream then uses ``object_id + 100 * cav_id``). Each CAV lists the toy vehicles
    whose box centre is within 100 m (x-y) of its LiDAR, from its toy yaml (itself excluded, the other CAV in).
  - ``obj_type``: ``Car`` below 5 m long, otherwise ``Van``; in about half the frames one long vehicle is
    relabelled ``Truck`` (the same one for both CAVs); every CAV frame also lists one or two ``Pedestrian``
    objects (standing on the ground within 30 m, ``ass_id`` -1, no points in the cloud): the reader must drop
    ``Pedestrian`` and keep every other class as a vehicle.

Random choices come from numpy Generators keyed by (seed, split index, scenario index[, cav, frame]), so the
same source and seed give byte-identical files. A ``toy_manifest.yaml`` (``toy.manifest``) makes a complete copy
with the same identity reused, and a source that is not a complete toy OPV2V set is refused.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import yaml

from opencood_ddp.data.geometry import matrix_to_pose, pose_to_matrix
from opencood_ddp.data.opv2v import ego_speed_of, is_rsu_id, lidar_pose_of, load_opv2v_yaml, order_cav_ids
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.toy.config import GROUND_Z, SPLITS
from opencood_ddp.toy.manifest import (MANIFEST_NAME, ToySetKind, is_complete_match, read_toy_manifest,
                                       write_toy_set)

LAYOUT = "v2v4real"
# Bump whenever the written bytes change for a given source and seed, so stale copies are rewritten.
LAYOUT_VERSION = 2
# The copy's own manifest kind: the same split folders as the toy OPV2V set, so that neither writer takes the other's
# folder for its own.
V2V4REAL_SET = ToySetKind("opencood_ddp-toy-v2v4real", SPLITS, tuple(f"{split}/*/*/*.pcd" for split in SPLITS),
                          "the V2V4Real-layout toy copy")
# V2V4Real has exactly two vehicles per scenario, folders "0" and "1".
CAVS_PER_SCENARIO = 2
SCENARIO_PREFIX = "testoutput_CAV_data_"
# A CAV lists the toy vehicles whose box centre is this close to its LiDAR (x-y distance, metres).
LIST_RADIUS_M = 100.0
# Full box length from which a vehicle is a "Van" rather than a "Car".
VAN_MIN_LENGTH_M = 5.0
# Offset of the box centre from `location`, in the CAV frame: non-zero so that `center` matters.
CENTER_OFFSET_M = 0.05
# Upstream's id of an unassociated object is object_id + 100 * cav_id, i.e. below 100 * max_cav (<= 900 for
# up to 9 CAVs); toy vehicle ids start at 100, so a bare toy id as ass_id could equal such an id and
# upstream's de-duplication would silently drop a different box. Shifting by 1000 keeps the two ranges apart.
ASS_ID_OFFSET = 1000
# Objects a CAV may list: a 101st object would reach the id range of the next CAV (object_id + 100 * cav_id).
MAX_OBJECTS_PER_CAV = 100
TRUCK_PROBABILITY = 0.5
PEDESTRIAN_EXTENT = (0.3, 0.3, 0.9)
PEDESTRIAN_RANGE_M = (5.0, 30.0)

_TOY_SCENARIO_NAME = re.compile(r"(\d{4})_(\d{2})_(\d{2})_(\d{2})_(\d{2})_(\d{2})")


# --------------------------------------------------------------------------------------------- public API


def write_v2v4real_copy(opv2v_root, out_dir, seed: int = 0) -> dict:
    """Write a V2V4Real-layout copy of the complete toy OPV2V set at opv2v_root into out_dir; return a summary.

    A complete copy with the same identity (seed, layout version, source set) already in out_dir is reused
    (summary['skipped'] True); an earlier toy set or copy there is replaced; any other non-empty folder is
    refused, as is a source that is not a complete toy OPV2V set (one DataError line each).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"V2V4Real copy seed {seed!r} must be a non-negative integer")
    source, out = Path(opv2v_root), Path(out_dir)
    identity = {"format": V2V4REAL_SET.format, "layout": LAYOUT, "layout_version": LAYOUT_VERSION,
                "seed": int(seed), "source": _source_identity(source)}
    _refuse_overlap(source, out)
    return write_toy_set(out, identity, V2V4REAL_SET, lambda: lambda: dict(
        _copy_all_splits(source, out, int(seed)), seed=int(seed), source_dir=str(source)))


def format_v2v4real_summary(summary: dict) -> str:
    """One paragraph for people: what was written (or reused), how big, how long it took."""
    frames, scenarios = summary["frames"], summary["scenarios"]
    if summary.get("skipped"):
        verb, timing = "Reused the complete V2V4Real-layout copy in", f"written earlier in {summary['seconds']:.1f} s"
    else:
        verb, timing = "Wrote a V2V4Real-layout copy to", f"written in {summary['seconds']:.1f} s"
    return (f"{verb} {summary['out_dir']} (seed {summary['seed']}, from {summary['source_dir']}): "
            f"{frames['train']} train / {frames['validate']} validate / {frames['test']} test frames in "
            f"{scenarios['train']}/{scenarios['validate']}/{scenarios['test']} scenarios, "
            f"{CAVS_PER_SCENARIO} CAVs per scenario ({summary['clouds']} point clouds), {timing}.")


def dump_v2v4real_yaml(frame: Mapping) -> str:
    """The text of one frame yaml: keys sorted, block style, ndarrays in the numpy 1.x PyYAML form."""
    return yaml.dump(dict(frame), Dumper=_V2V4RealDumper, sort_keys=True, default_flow_style=False)


# ------------------------------------------------------------------------------------- the yaml dumper


class _V2V4RealDumper(yaml.SafeDumper):
    """A safe dumper that also writes float64 ndarrays as PyYAML's unsafe Dumper did under numpy 1.x.

    It shares the pure-Python emitter of ``yaml.dump``'s default Dumper, so an ndarray's text is the one that
    Dumper writes, the numpy 1.x module path aside (a test compares the two). Aliases are never written: a list
    shared by two objects must not become ``&id001``.
    """

    def ignore_aliases(self, data) -> bool:
        return True


_TAG = "tag:yaml.org,2002:"
_RECONSTRUCT_TAG = _TAG + "python/object/apply:numpy.core.multiarray._reconstruct"
_DTYPE_TAG = _TAG + "python/object/apply:numpy.dtype"
_TUPLE_TAG = _TAG + "python/tuple"
# numpy 1.x's ndarray.__reduce__: _reconstruct(ndarray, (0,), b'b'), then __setstate__ with
# (version 1, shape, dtype, is_fortran, raw bytes); dtype('<f8').__reduce__: dtype('f8', False, True) with
# state (3, '<', None, None, None, -1, -1, 0).
_F8_DTYPE_STATE = (3, "<", None, None, None, -1, -1, 0)


def _scalar(dumper: yaml.SafeDumper, value) -> yaml.Node:
    """A plain scalar node as the safe representer writes it (int, bool, None, str, bytes as !!binary)."""
    return dumper.represent_data(value)


def _tuple_node(items: Sequence[yaml.Node]) -> yaml.SequenceNode:
    """A ``!!python/tuple`` of already-built nodes, in block style as ``yaml.dump`` writes it."""
    return yaml.SequenceNode(_TUPLE_TAG, list(items), flow_style=False)


def _mapping_node(tag: str, pairs: Sequence[Tuple[str, yaml.Node]], dumper: yaml.SafeDumper) -> yaml.MappingNode:
    return yaml.MappingNode(tag, [(_scalar(dumper, key), node) for key, node in pairs], flow_style=False)


def _represent_float64_array(dumper: yaml.SafeDumper, array: np.ndarray) -> yaml.Node:
    """The node numpy 1.x + PyYAML's Representer.represent_object built for a C-ordered float64 ndarray."""
    if array.dtype != np.float64:
        raise ValueError(f"only float64 arrays are written in V2V4Real yaml, got {array.dtype}")
    raw = np.ascontiguousarray(array, dtype="<f8").tobytes()
    dtype_node = _mapping_node(_DTYPE_TAG, [
        ("args", yaml.SequenceNode(_TAG + "seq", [_scalar(dumper, v) for v in ("f8", False, True)],
                                   flow_style=False)),
        ("state", _tuple_node([_scalar(dumper, v) for v in _F8_DTYPE_STATE])),
    ], dumper)
    args = yaml.SequenceNode(_TAG + "seq", [
        yaml.ScalarNode(_TAG + "python/name:numpy.ndarray", ""),
        _tuple_node([_scalar(dumper, 0)]),
        _scalar(dumper, b"b"),
    ], flow_style=False)
    state = _tuple_node([
        _scalar(dumper, 1),
        _tuple_node([_scalar(dumper, int(n)) for n in array.shape]),
        dtype_node,
        _scalar(dumper, False),
        _scalar(dumper, raw),
    ])
    return _mapping_node(_RECONSTRUCT_TAG, [("args", args), ("state", state)], dumper)


_V2V4RealDumper.add_representer(np.ndarray, _represent_float64_array)


# ------------------------------------------------------------------------------------------- the source


def _source_identity(source: Path) -> dict:
    """The toy OPV2V set's identity (its manifest less summary/complete), or one DataError line."""
    fix = f"generate it first (python tools/make_toy_opv2v.py --out {source}) or point at such a folder"
    if not source.is_dir():
        raise DataError(f"{source}: no such folder, so no toy OPV2V set to copy into the V2V4Real layout; {fix}")
    manifest = read_toy_manifest(source)
    if manifest is None:
        raise DataError(f"{source}: not a toy OPV2V set (no {MANIFEST_NAME} of the toy generator); {fix}")
    identity = {k: v for k, v in manifest.items() if k not in ("summary", "complete")}
    if not is_complete_match(source, manifest, identity):
        raise DataError(f"{source}: the toy OPV2V set is incomplete (interrupted, or point clouds missing); "
                        f"{fix}")
    return identity


def _refuse_overlap(source: Path, out: Path) -> None:
    """Writing into the source (or the source inside the output) would delete the very set being copied."""
    src, dst = source.resolve(), out.resolve()
    if src == dst or src in dst.parents or dst in src.parents:
        raise DataError(f"{out}: the V2V4Real copy must not be written into (or around) its source {source}; "
                        f"choose a separate output folder")


def _subdirectories(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _kept_cavs(scenario: Path) -> List[str]:
    """The toy scenario's first two vehicle folders in the OPV2V reader's order; RSUs are never kept."""
    names = _subdirectories(scenario)
    vehicles = [name for name in order_cav_ids(names, len(names)) if not is_rsu_id(name)]
    if len(vehicles) < CAVS_PER_SCENARIO:
        raise DataError(f"{scenario}: V2V4Real scenarios hold two vehicles but this toy scenario has "
                        f"{len(vehicles)} CAV folder(s); generate the toy set with min_cavs >= 2")
    return vehicles[:CAVS_PER_SCENARIO]


def _timestamps(cav_folder: Path) -> List[str]:
    """Sorted yaml stems, skipping names with 'additional' (as both readers do)."""
    return sorted(p.stem for p in cav_folder.glob("*.yaml") if "additional" not in p.name)


def _scenario_folder_name(toy_name: str, index: int, scenario: Path) -> str:
    """``2021_08_16_22_26_54`` and k -> ``testoutput_CAV_data_2021-08-16-22-26-54_<k>``."""
    match = _TOY_SCENARIO_NAME.fullmatch(toy_name)
    if match is None:
        raise DataError(f"{scenario}: scenario name is not a toy date-time (YYYY_MM_DD_HH_MM_SS); regenerate the "
                        f"toy OPV2V set")
    return f"{SCENARIO_PREFIX}{'-'.join(match.groups())}_{index}"


# ---------------------------------------------------------------------------------------------- copying


def _copy_all_splits(source: Path, out: Path, seed: int) -> dict:
    frames: Dict[str, int] = {}
    scenarios: Dict[str, int] = {}
    for split_index, split in enumerate(SPLITS):
        split_dir = source / split
        names = _subdirectories(split_dir) if split_dir.is_dir() else []
        (out / split).mkdir(parents=True)
        frames[split] = 0
        for k, name in enumerate(names):
            frames[split] += _copy_scenario(split_dir / name, out / split, seed, split_index, k)
        scenarios[split] = len(names)
    return {"scenarios": scenarios, "frames": frames, "clouds": CAVS_PER_SCENARIO * sum(frames.values())}


def _copy_scenario(scenario: Path, split_out: Path, seed: int, split_index: int, k: int) -> int:
    """Write one scenario of the copy; returns its number of frames."""
    cavs = _kept_cavs(scenario)
    stamps = _timestamps(scenario / cavs[0])
    for cav in cavs[1:]:
        if _timestamps(scenario / cav) != stamps:
            raise DataError(f"{scenario / cav}: its timestamps differ from CAV {cavs[0]}'s; regenerate the toy "
                            f"OPV2V set")
    target = split_out / _scenario_folder_name(scenario.name, k, scenario)
    folders = [target / str(i) for i in range(CAVS_PER_SCENARIO)]
    for folder in folders:
        folder.mkdir(parents=True)
    # Scenario-wide draws (which frames show a Truck, and which vehicle) come from one Generator, frame by frame.
    scenario_rng = np.random.default_rng((seed, split_index, k))
    for frame, stamp in enumerate(stamps):
        yaml_paths = [scenario / cav / f"{stamp}.yaml" for cav in cavs]
        params = [load_opv2v_yaml(path) for path in yaml_paths]
        listed = [_vehicles_in_radius(p, path) for p, path in zip(params, yaml_paths)]
        truck = _draw_truck(scenario_rng, listed)
        shared = set(listed[0]).intersection(listed[1])
        for cav_index, folder in enumerate(folders):
            rng = np.random.default_rng((seed, split_index, k, cav_index, frame))
            pose = pose_to_matrix(lidar_pose_of(params[cav_index], yaml_paths[cav_index]))
            content = {"ego_speed": ego_speed_of(params[cav_index], yaml_paths[cav_index]), "lidar_pose": pose,
                       "vehicles": _frame_objects(listed[cav_index], shared, truck, pose, rng,
                                                  yaml_paths[cav_index])}
            out_stamp = f"{frame:06d}"
            (folder / f"{out_stamp}.yaml").write_text(dump_v2v4real_yaml(content), encoding="utf-8")
            shutil.copyfile(scenario / cavs[cav_index] / f"{stamp}.pcd", folder / f"{out_stamp}.pcd")
    return len(stamps)


def _vehicles_in_radius(params: Mapping, path: Path) -> Dict[int, dict]:
    """The toy vehicles (world frame) whose box centre lies within LIST_RADIUS_M of the CAV's LiDAR, by id."""
    lidar_xy = lidar_pose_of(params, path)[:2]
    vehicles = params.get("vehicles") or {}
    if not isinstance(vehicles, Mapping):
        raise DataError(f"{path}: 'vehicles' is not a mapping of vehicle id -> box; regenerate the toy OPV2V set")
    kept = {}
    for vehicle_id, box in vehicles.items():
        try:
            centre = np.asarray(box["location"], dtype=np.float64) + np.asarray(box["center"], dtype=np.float64)
            fields = {key: [float(v) for v in box[key]] for key in ("location", "center", "angle", "extent")}
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path}: vehicle {vehicle_id} lacks 3-number location/center/angle/extent; "
                            f"regenerate the toy OPV2V set") from None
        if np.hypot(*(centre[:2] - lidar_xy)) <= LIST_RADIUS_M:
            kept[int(vehicle_id)] = fields
    return dict(sorted(kept.items()))


def _draw_truck(rng: np.random.Generator, listed: Sequence[Mapping[int, dict]]) -> Optional[int]:
    """In about half the frames, one long vehicle (listed by either CAV) becomes a Truck for both CAVs."""
    long_ids = sorted({vid for vehicles in listed for vid, box in vehicles.items()
                       if 2.0 * box["extent"][0] >= VAN_MIN_LENGTH_M})
    # Both draws are made in every frame, so one frame's choice never shifts the next frame's.
    relabel, pick = rng.random() < TRUCK_PROBABILITY, rng.random()
    if not relabel or not long_ids:
        return None
    return long_ids[int(pick * len(long_ids))]


def _obj_type(vehicle_id: int, box: Mapping, truck: Optional[int]) -> str:
    if vehicle_id == truck:
        return "Truck"
    return "Car" if 2.0 * box["extent"][0] < VAN_MIN_LENGTH_M else "Van"


def _pedestrians(rng: np.random.Generator, lidar_to_world: np.ndarray) -> List[dict]:
    """One or two pedestrians standing on the ground within 30 m of the LiDAR (world frame, toy fields)."""
    people = []
    for _ in range(int(rng.integers(1, 3))):
        distance = rng.uniform(*PEDESTRIAN_RANGE_M)
        bearing, heading = rng.uniform(-np.pi, np.pi), rng.uniform(-180.0, 180.0)
        x = lidar_to_world[0, 3] + distance * np.cos(bearing)
        y = lidar_to_world[1, 3] + distance * np.sin(bearing)
        people.append({"location": [float(x), float(y), GROUND_Z], "center": [0.0, 0.0, PEDESTRIAN_EXTENT[2]],
                       "angle": [0.0, float(heading), 0.0], "extent": list(PEDESTRIAN_EXTENT)})
    return people


def _local_fields(box: Mapping, world_to_lidar: np.ndarray) -> dict:
    """A toy box (world frame) as V2V4Real's fields in the CAV's LiDAR frame (location + center, angle)."""
    world_pose = [*(np.asarray(box["location"]) + np.asarray(box["center"])), *box["angle"]]
    local = matrix_to_pose(world_to_lidar @ pose_to_matrix(world_pose))
    center = np.array([CENTER_OFFSET_M, 0.0, 0.0])
    # Six decimals (micrometres, micro-degrees), as the toy OPV2V writer's: the same text per number as the set it
    # copies, so that the two readers' throughputs compare like for like. "+ 0.0" turns the -0.0 that atan2 (or
    # rounding) gives a level box into 0.0, so the yaml reads 0.0, not -0.0.
    return {"angle": [round(float(v), 6) + 0.0 for v in local[3:]], "center": [float(v) for v in center],
            "extent": [float(v) for v in box["extent"]],
            "location": [round(float(v), 6) + 0.0 for v in local[:3] - center]}


def _frame_objects(vehicles: Mapping[int, dict], shared: set, truck: Optional[int], lidar_to_world: np.ndarray,
                   rng: np.random.Generator, path: Path) -> Dict[int, dict]:
    """The ``vehicles`` mapping of one CAV frame: its vehicles by toy id, then its pedestrians, ids 0, 1, ..."""
    world_to_lidar = np.linalg.inv(lidar_to_world)
    objects: Dict[int, dict] = {}
    for vehicle_id, box in vehicles.items():
        ass_id = ASS_ID_OFFSET + vehicle_id if vehicle_id in shared else -1
        objects[len(objects)] = dict(_local_fields(box, world_to_lidar), ass_id=ass_id,
                                     obj_type=_obj_type(vehicle_id, box, truck))
    for person in _pedestrians(rng, lidar_to_world):
        objects[len(objects)] = dict(_local_fields(person, world_to_lidar), ass_id=-1, obj_type="Pedestrian")
    if len(objects) > MAX_OBJECTS_PER_CAV:
        raise DataError(f"{path}: {len(objects)} objects within {LIST_RADIUS_M:.0f} m, but V2V4Real's ids "
                        f"(object_id + 100 * cav_id) allow {MAX_OBJECTS_PER_CAV}; use a toy set with fewer "
                        f"vehicles")
    return objects
