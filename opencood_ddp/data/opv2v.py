"""OPV2V split scanner and frame reader with upstream OpenCOOD's ordering and selection rules.

On disk a split is ``<split>/<scenario>/<cav_id>/<timestamp>.yaml`` (+ ``.pcd``, camera images). The rules
below are upstream's (``BaseDataset.__init__`` / ``retrieve_base_data`` and the fusion datasets):

- Scenarios are the sub-directories of the split, sorted as strings; plain files are ignored.
- In a scenario, CAV folders are the sub-directories sorted as strings (so ``data_protocol.yaml`` is not a
  CAV); negative ids (V2XSet road-side units, RSUs) go to the end; the first remaining folder is the ego; at
  most ``max_cav`` folders are kept (upstream drops the rest, RSUs first since they sit at the end). Each
  record and frame carries ``infra`` (True for an RSU), the flag V2X-ViT's prior encoding reads.
- A CAV's timestamps are its ``*.yaml`` names without the suffix, sorted, skipping names containing
  ``additional``. The dataset length is the ego's timestamp count summed over scenarios; sample ``i`` is
  the ego's timestamp at that position, and every kept CAV is read at the same timestamp (with a
  communication delay, ``wild_setting.async``, at an earlier one of the same scenario: ``ScenarioFrames``).
- Communication range: a non-ego CAV whose lidar position is more than ``comm_range`` (70 m) from the
  ego's in x-y is dropped from the frame (kept at exactly 70 m).

Departures from upstream, for robustness and identical on well-formed OPV2V/V2XSet data:
- upstream moves only the *first* sorted folder to the end when its id is negative; here every
  negative id moves (keeping their sorted order), so two RSUs can never make one of them the ego;
- a scenario whose kept folders are all RSUs is refused at scan time (upstream makes an RSU the ego);
- a CAV lacking one of the ego's timestamps is reported at scan time (upstream fails mid-epoch).

YAML is parsed once per CAV and frame with libyaml's C loader when present, plus upstream's extra
float rule (``1e-3`` is a float, not a string) and a safe constructor for ``!!python/tuple``; the document
is built through ``fast_yaml`` (the same value, about twice as fast).
The point clouds themselves are read elsewhere (``opencood_ddp.data.pcd``).
"""
from __future__ import annotations

import bisect
import dataclasses
import numbers
import operator
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import yaml

from opencood_ddp.data import fast_yaml
from opencood_ddp.data.geometry import xy_distance
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.numpy_yaml import TUPLE_TAG, construct_tuple

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_MAX_CAV = 7
COMM_RANGE = 70.0  # metres, upstream's COM_RANGE

# ------------------------------------------------------------------------------------------- YAML

_SafeBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml is ~10x faster on OPV2V's big files

# YAML 1.1 (PyYAML's default) reads "1e-3" or "2E5" (an exponent with no dot) as strings; upstream's
# load_yaml adds a resolver that makes them floats. This pattern accepts the same scalars as that one.
_FLOAT_PATTERN = re.compile(
    r"""^(?:
        [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?     # 1.5  1.  1.5e3  1.5e-3
      | [-+]?[0-9][0-9_]*[eE][-+]?[0-9]+                   # 1e-3  2E5 (no dot)
      | \.[0-9_]+(?:[eE][-+][0-9]+)?                       # .5  .5e-3
      | [-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*        # sexagesimal 1:30.5
      | [-+]?\.(?:inf|Inf|INF)
      | \.(?:nan|NaN|NAN)
    )$""",
    re.X,
)


class Opv2vYamlLoader(_SafeBase):  # type: ignore[misc, valid-type]
    """Safe YAML loader parsing OPV2V frame files to the same values as upstream's ``load_yaml``.

    Upstream uses PyYAML's unsafe pure-Python ``Loader``; this one is safe and C-accelerated, adds the
    same float resolver and builds ``!!python/tuple`` as a tuple. Other ``!!python/...`` tags are refused.
    """


# Registered on the subclass only: add_implicit_resolver copies the table, so yaml's loaders are untouched.
Opv2vYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_PATTERN, list("-+0123456789."))
Opv2vYamlLoader.add_constructor(TUPLE_TAG, construct_tuple)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One-line description of a YAML error (PyYAML's own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def load_yaml_bytes(data: bytes, loader: type) -> Any:
    """``yaml.load(data, Loader=loader)``, through fast_yaml's route when the document allows it (same value)."""
    try:
        return fast_yaml.load(data, loader)
    except (fast_yaml.HandBack, yaml.YAMLError, ValueError, TypeError):
        return yaml.load(data, Loader=loader)  # the loader's own value, or its own error


READS = "only plain YAML and !!python/tuple are read"


def load_opv2v_yaml(path: PathLike, loader: type = Opv2vYamlLoader) -> Dict[str, Any]:
    """Parse one OPV2V frame yaml into a dict; DataError (one line, naming the file) when it cannot. ``loader``: a
    safe loader of this module's kind (V2V4Real's adds its numpy arrays)."""
    try:
        with open(path, "rb") as stream:
            data = stream.read()
        params = load_yaml_bytes(data, loader)
    except FileNotFoundError:
        raise DataError(f"{path}: frame yaml not found (moved or deleted after scanning); restore it "
                        f"or rebuild the dataset index") from None
    except yaml.constructor.ConstructorError as exc:
        # Upstream's unsafe loader would build arbitrary Python objects here; we refuse them.
        problem = _yaml_problem(exc)
        fix = ("V2V4Real's frames hold numpy arrays: read its splits with fusion.dataset: v2v4real (a V2V4Real "
               "config), or evaluate an OPV2V-layout split" if "numpy" in problem and loader is Opv2vYamlLoader
               else "re-export the file without other Python object tags")
        raise DataError(f"{path}: unsupported YAML tag ({problem}); {getattr(loader, 'READS', READS)}: "
                        f"{fix}") from None
    except yaml.YAMLError as exc:
        raise DataError(f"{path}: malformed YAML ({_yaml_problem(exc)}); re-download or repair the "
                        f"file") from None
    except (ValueError, TypeError) as exc:  # PyYAML's constructors on a mistagged scalar, e.g. '!!int x'
        raise DataError(f"{path}: malformed YAML value ({' '.join(str(exc).split())}); re-download or repair "
                        f"the file") from None
    if not isinstance(params, dict):
        raise DataError(f"{path}: expected a mapping of frame fields, got {type(params).__name__}; "
                        f"re-download or repair the file")
    return params


def ego_speed_of(params: Dict[str, Any], path: PathLike) -> float:
    """The frame's ``ego_speed`` in km/h (OPV2V and V2XSet write km/h; an RSU writes 0); DataError naming
    ``path`` when absent or not a number."""
    speed = params.get("ego_speed")
    # numbers.Real: Python's int and float, and the numpy scalars a V2V4Real frame may hold (np.float32, np.int64)
    if isinstance(speed, (bool, np.bool_)) or not isinstance(speed, numbers.Real):
        problem = "no 'ego_speed'" if speed is None else f"'ego_speed' must be a number (km/h), got {speed!r}"
        raise DataError(f"{path}: {problem}; V2X-ViT's prior encoding reads it: re-export the frame yaml")
    return float(speed)


def checked_pose(params: Mapping[str, Any], path: PathLike, shape: Tuple[int, ...], what: str, fix: str) -> np.ndarray:
    """A frame's ``lidar_pose`` as finite float64 of ``shape``, the one check of every reader: a DataError line naming
    ``path`` and ``what`` a pose is there when it is absent, of another shape or not finite (a NaN pose would place
    every point and box at NaN and train on nothing)."""
    if "lidar_pose" not in params:
        raise DataError(f"{path}: no 'lidar_pose' ({what}); {fix}")
    try:
        pose = np.asarray(params["lidar_pose"], dtype=np.float64)
    except (TypeError, ValueError):
        pose = np.empty(0)
    if pose.shape != shape or not np.isfinite(pose).all():
        got = f"shape {pose.shape}" if pose.size and pose.shape != shape else repr(params["lidar_pose"])
        raise DataError(f"{path}: 'lidar_pose' must be {what}, finite, got {got}; {fix}")
    return pose


def lidar_pose_of(params: Dict[str, Any], path: PathLike) -> np.ndarray:
    """The frame's ``lidar_pose`` as float64 (6,); DataError naming ``path`` when absent or malformed."""
    return checked_pose(params, path, (6,), "6 numbers [x, y, z, roll, yaw, pitch]",
                        "this is not an OPV2V frame yaml as it should be: re-export it or remove the timestamp")


# ---------------------------------------------------------------------------------------- index


@dataclass(frozen=True)
class CavRecord:
    """One CAV folder of a scenario: its id (folder name), path and sorted timestamps."""

    cav_id: str
    folder: Path
    timestamps: Tuple[str, ...]

    @property
    def infra(self) -> bool:
        """A road-side unit (V2XSet infrastructure): its folder name is a negative integer."""
        return is_rsu_id(self.cav_id)

    def yaml_path(self, timestamp: str) -> Path:
        return self.folder / f"{timestamp}.yaml"

    def pcd_path(self, timestamp: str) -> Path:
        return self.folder / f"{timestamp}.pcd"


@dataclass(frozen=True)
class Scenario:
    """A scenario folder with its kept CAVs in upstream order; ``cavs[0]`` is the ego."""

    name: str
    folder: Path
    cavs: Tuple[CavRecord, ...]

    @property
    def ego(self) -> CavRecord:
        return self.cavs[0]

    @property
    def timestamps(self) -> Tuple[str, ...]:
        """The ego's timestamps: one sample each."""
        return self.ego.timestamps

    @property
    def cav_ids(self) -> Tuple[str, ...]:
        return tuple(cav.cav_id for cav in self.cavs)


@dataclass(frozen=True)
class Opv2vIndex:
    """Every scenario of a split; sample ``i`` is found by ``locate(i)``. Picklable, cheap to copy."""

    root: Path
    scenarios: Tuple[Scenario, ...]
    max_cav: int = DEFAULT_MAX_CAV
    comm_range: float = COMM_RANGE
    # Exclusive end of each scenario's sample range, e.g. (5, 5, 12) for 5, 0 and 7 ego timestamps.
    ends: Tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        running, ends = 0, []
        for scenario in self.scenarios:
            running += len(scenario.timestamps)
            ends.append(running)
        object.__setattr__(self, "ends", tuple(ends))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def locate(self, i: int) -> Tuple[Scenario, str]:
        """Sample index -> (scenario, ego timestamp). IndexError outside ``[0, len)``."""
        scenario, position = self.locate_position(i)
        return scenario, scenario.timestamps[position]

    def locate_position(self, i: int) -> Tuple[Scenario, int]:
        """Sample index -> (scenario, position of its ego timestamp in ``scenario.timestamps``), so that a dataset
        can read the frames before it (``ScenarioFrames``). IndexError outside ``[0, len)``."""
        i = operator.index(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples in {self.root}")
        k = bisect.bisect_right(self.ends, i)  # first scenario whose end exceeds i (skips empty ones)
        start = self.ends[k - 1] if k else 0
        return self.scenarios[k], i - start


def _subdirectories(folder: Path) -> List[str]:
    """Names of the sub-directories of ``folder`` (symlinks followed), sorted as strings."""
    with os.scandir(folder) as entries:
        return sorted(entry.name for entry in entries if entry.is_dir())


def is_rsu_id(name: str) -> bool:
    """Whether a CAV folder name is a road-side unit's: a negative integer, as V2XSet names them ('-1')."""
    try:
        return int(name) < 0
    except ValueError:
        return False  # a non-numeric folder name is not a road-side unit (upstream's int() would raise)


def order_cav_ids(names: List[str], max_cav: int) -> List[str]:
    """Upstream CAV order: string sort, negative ids (RSUs) last, at most ``max_cav`` kept."""
    ordered = sorted(names)
    ordered = [n for n in ordered if not is_rsu_id(n)] + [n for n in ordered if is_rsu_id(n)]
    return ordered[:max_cav]


# Yaml names that are not frames: upstream skips OPV2V's "additional" files (V2V4Real's fork also "camera_gt").
NOT_FRAMES: Tuple[str, ...] = ("additional",)


def _timestamps(cav_folder: Path, not_frames: Tuple[str, ...]) -> Tuple[str, ...]:
    """Sorted yaml stems of a CAV folder, skipping files whose name contains one of ``not_frames``."""
    with os.scandir(cav_folder) as entries:
        names = [e.name for e in entries if e.name.endswith(".yaml") and not any(word in e.name for word in not_frames)]
    return tuple(name[: -len(".yaml")] for name in sorted(names))


def check_cav_timestamps(ego: CavRecord, cav: CavRecord) -> None:
    """Every kept CAV is read at each ego timestamp, so a gap would fail mid-epoch: report it now."""
    missing = sorted(set(ego.timestamps).difference(cav.timestamps))
    if missing:
        raise DataError(
            f"{cav.yaml_path(missing[0])}: CAV {cav.cav_id} lacks timestamp {missing[0]} of its ego "
            f"{ego.cav_id} ({len(missing)} missing); restore the files or remove the folder {cav.folder}"
        )


def _scan_scenario(folder: Path, max_cav: int, not_frames: Tuple[str, ...]) -> Scenario:
    cav_ids = order_cav_ids(_subdirectories(folder), max_cav)
    # Frames themselves (timestamp yamls; a scenario's own data_protocol.yaml is not one): a CAV folder, so the
    # path given was a scenario, not a split.
    if not cav_ids and any(stem.isdigit() for stem in _timestamps(folder, not_frames)):
        raise DataError(f"{folder}: holds frames (<timestamp>.yaml), not CAV folders: it is a CAV folder, so "
                        f"{folder.parent} is a scenario, not a split; point at the split folder that holds the "
                        f"scenarios, such as {folder.parent.parent}")
    if not cav_ids:
        raise DataError(f"{folder}: scenario has no CAV folder (<cav_id>/<timestamp>.yaml); restore its "
                        f"CAV folders or remove the scenario")
    if is_rsu_id(cav_ids[0]):  # RSUs sort last, so the first kept folder is one only when all are
        raise DataError(f"{folder}: every CAV folder is a road-side unit (negative id: {', '.join(cav_ids)}) and "
                        f"an RSU is never the ego; add the vehicles' folders or remove the scenario")
    cavs = tuple(CavRecord(cid, folder / cid, _timestamps(folder / cid, not_frames)) for cid in cav_ids)
    for cav in cavs[1:]:
        check_cav_timestamps(cavs[0], cav)
    return Scenario(folder.name, folder, cavs)


def _split_fix(key: str, fix: Optional[str] = None) -> str:
    """How to point ``key`` (a hypes key such as root_dir, or a flag such as --dataset_dir) at another split, up to
    what the split must be; ``fix``: the caller's own words for the first part (an evaluation tool has no --set)."""
    if fix is None:
        fix = f"pass {key}" if key.startswith("--") else f"set {key} in the hypes (or --set {key}=PATH) to"
    return f"{fix} an OPV2V split folder"


# Folder names of a data set's splits: a folder holding them is the data set's root, not a split.
SPLIT_NAMES = ("train", "validate", "test", "val", "training", "testing", "validation", "test_culver_city")


def split_root(root_dir: PathLike, key: str = "root_dir", fix: Optional[str] = None) -> Path:
    """``root_dir`` as a Path, checked to be a folder holding scenario sub-folders; ``key`` (the hypes key or flag
    the path came from) names it in the error, and ``fix`` (default: how to set ``key``) says how to point it at
    another split, in the words before "an OPV2V split folder"."""
    root = Path(root_dir)
    layout = "holding <scenario>/<cav_id>/<timestamp>.yaml"
    how = _split_fix(key, fix)
    if not root.is_dir():
        problem = "is a file, not a split folder" if root.exists() else "split folder not found"
        raise DataError(f"{key} {root}: {problem}; {how} {layout}")
    folders = _subdirectories(root)
    if not folders:
        raise DataError(f"{key} {root}: no scenario folder in this split (empty split); {how} {layout}")
    splits = [name for name in folders if name in SPLIT_NAMES]
    if splits:  # else its splits would be read as scenarios, to fail later as an "empty split" under another key
        raise DataError(f"{key} {root}: holds the splits {', '.join(splits)}, not scenarios: it is the data set's "
                        f"root; {how} such as {root / splits[0]}")
    return root


def check_split_shape(root_dir: PathLike, key: str, fix: Optional[str] = None,
                      not_frames: Tuple[str, ...] = NOT_FRAMES) -> Path:
    """``split_root``, then the first scenario as the scan reads it, its ego alone: what tells a split from another
    data set's root or from a scenario, at the cost of one scenario's listings (the dataset's scan, later, reads
    the rest with the run's max_cav). Errors name ``key``."""
    root = split_root(root_dir, key, fix)
    first = _scan_scenario(root / _subdirectories(root)[0], 1, not_frames)
    if not first.ego.timestamps:
        raise DataError(f"{key} {root}: {first.ego.folder} holds no timestamp yaml; {_split_fix(key, fix)} "
                        f"holding <scenario>/<cav_id>/<timestamp>.yaml")
    return root


def scan_split(root_dir: PathLike, max_cav: int = DEFAULT_MAX_CAV, comm_range: float = COMM_RANGE,
               key: str = "root_dir", not_frames: Tuple[str, ...] = NOT_FRAMES) -> Opv2vIndex:
    """Index an OPV2V split folder (file names only: no yaml is parsed). See the module docstring.

    ``key`` is where the folder came from (root_dir, validate_dir, test_dir, --dataset_dir): errors name it.
    ``not_frames``: words of yaml names that are not frames."""
    if max_cav < 1:
        raise ConfigError(f"train_params.max_cav must be >= 1, got {max_cav}; fix the hypes YAML")
    root = split_root(root_dir, key)
    index = Opv2vIndex(root, tuple(_scan_scenario(root / n, max_cav, not_frames) for n in _subdirectories(root)),
                       max_cav, float(comm_range))
    if len(index) == 0:
        raise DataError(f"{key} {root}: no timestamp yaml in any ego CAV folder (empty split); check that the "
                        f"split was fully extracted")
    return index


# ---------------------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class CavFrame:
    """One CAV at one timestamp, as a data source read it (``data/sources``): what it parsed, its LiDAR pose, its
    point-cloud path and its ego and road-side flags. OPV2V and V2V4Real: one yaml, parsed once."""

    cav_id: str
    params: Dict[str, Any]  # what the source parsed for this frame (OPV2V: the frame yaml)
    # float64: OPV2V's [x, y, z, roll, yaw, pitch] (CARLA world, degrees; also DAIR-V2X's calibration chain, as HEAL
    # stores it) or V2V4Real's (4, 4) LiDAR-to-world matrix; geometry.x1_to_x2 takes either
    lidar_pose: np.ndarray
    pcd_path: Path
    meta_path: Path  # the file that holds this frame's pose (named in error lines)
    ego: bool
    distance_to_ego: float  # x-y distance between this lidar and the ego's, metres
    infra: bool = False  # a road-side unit (infra = 1 in V2X-ViT's prior encoding); the ego only in DAIR-V2X-C's swap


FrameReader = Callable[[CavRecord, str, bool], CavFrame]


def read_opv2v_frame(cav: CavRecord, timestamp: str, ego: bool) -> CavFrame:
    """One OPV2V/V2XSet CAV frame: its yaml parsed once; a negative folder id is a road-side unit."""
    path = cav.yaml_path(timestamp)
    params = load_opv2v_yaml(path)
    return CavFrame(cav.cav_id, params, lidar_pose_of(params, path), cav.pcd_path(timestamp), path, ego,
                    float("nan"), cav.infra)


def _read_cav(cav: CavRecord, timestamp: str, ego: bool, ego_pose: Optional[np.ndarray]) -> CavFrame:
    frame = read_opv2v_frame(cav, timestamp, ego)
    distance = 0.0 if ego_pose is None else xy_distance(frame.lidar_pose, ego_pose)
    return dataclasses.replace(frame, distance_to_ego=distance)


class ScenarioFrames:
    """The kept CAVs of one scenario around one sample, for delayed reads: ``frame(slot, lag)`` is CAV ``slot``
    (0 is the ego) ``lag`` frames before the sample's timestamp, read by ``read`` at most once per sample.

    As upstream (``return_timestamp_key``), frames are counted in the ego's timestamp list, which every kept CAV
    has (checked at scan time). A frame's ``distance_to_ego`` is NaN: the dataset measures the distance it needs
    (upstream: the sent pose against the ego's current one). A plain object, built per sample, never pickled.
    """

    def __init__(self, scenario: Scenario, position: int, read: FrameReader = read_opv2v_frame):
        self.scenario, self.position, self.read = scenario, position, read
        self._frames: Dict[Tuple[int, int], CavFrame] = {}

    @property
    def count(self) -> int:
        """How many CAVs the sample has (the scenario's kept CAVs, ego first)."""
        return len(self.scenario.cavs)

    def frame(self, slot: int, lag: int = 0) -> CavFrame:
        if not 0 <= lag <= self.position:
            raise ValueError(f"lag {lag} reaches before the first frame of scenario {self.scenario.name} from "
                             f"timestamp position {self.position}")
        key = (slot, lag)
        if key not in self._frames:
            timestamp = self.scenario.timestamps[self.position - lag]
            self._frames[key] = self.read(self.scenario.cavs[slot], timestamp, slot == 0)
        return self._frames[key]


def read_frame(index: Opv2vIndex, i: int, *, apply_comm_range: bool = True) -> "OrderedDict[str, CavFrame]":
    """Sample ``i`` -> ordered ``{cav_id: CavFrame}``, ego first, each CAV's yaml parsed exactly once.

    With ``apply_comm_range`` (upstream's early, intermediate and late-test datasets), CAVs farther than
    ``index.comm_range`` from the ego in x-y are left out; upstream's late-fusion *training* picks among
    all CAVs, which ``apply_comm_range=False`` gives.
    """
    scenario, timestamp = index.locate(i)
    ego = _read_cav(scenario.ego, timestamp, True, None)
    frame: "OrderedDict[str, CavFrame]" = OrderedDict([(ego.cav_id, ego)])
    for cav in scenario.cavs[1:]:
        cav_frame = _read_cav(cav, timestamp, False, ego.lidar_pose)
        if apply_comm_range and cav_frame.distance_to_ego > index.comm_range:
            continue
        frame[cav.cav_id] = cav_frame
    return frame
