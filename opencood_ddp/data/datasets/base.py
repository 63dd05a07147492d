"""What the three fusion datasets share: the split's source, the sample as the ego receives it, its ground truth,
its labels and voxels, and the seeded RNG. Upstream counterpart: ``opencood/data_utils/datasets/basedataset.py``
plus the parts of the post-processor the datasets call (``BasePostprocessor.generate_object_center``).

Each part is told where its code is: reproducibility at `OpencoodDataset`, the received CAVs (delay, pose error,
range) at `ReceivedCav` and `received_cavs` (the pure functions in data/wild.py), the ground truth at
`sample_objects` and `pad_objects`, and what the datasets call of a post-processor in `PostProcessor`.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from opencood_ddp.data.augment import WorldAugmentor, WorldTransform, sample_rng, shuffle_points
from opencood_ddp.data.device_points import RawCloud, RawLidar, collate_raw, shuffle_key, tell_non_finite, voxel_grid_of
from opencood_ddp.data.ground_truth import evaluation_gt_range
from opencood_ddp.data.geometry import (boxes_in_range_mask, boxes_to_corners, mask_ego_points,
                                        mask_points_by_range, transform_points, x1_to_x2, xy_distance)
from opencood_ddp.data.opv2v import DEFAULT_MAX_CAV, CavFrame
from opencood_ddp.data.pcd import read_pcd_header
from opencood_ddp.data.preprocessors import build_preprocessor, preprocessor_entry
from opencood_ddp.data.sources import Objects, SampleFrames, SplitSource, build_source, source_entry
from opencood_ddp.data.voxelize import Voxelizer, collate_voxels
from opencood_ddp.data.wild import SampleKey, perturb, pose_offset, sample_delays, wild_setting_from_hypes
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.hypes import get_key, hypes_source, range6, validate
from opencood_ddp.memory_fit import Buffer, refuse_beyond_memory

# Which hypes key holds each split's folder. Upstream has root_dir (train) and validate_dir and evaluates on
# validate_dir; test_dir is our extension for a held-out split.
SPLIT_KEYS: Dict[str, str] = {"train": "root_dir", "validate": "validate_dir", "test": "test_dir"}

COMMON_KEYS: Tuple[Tuple[str, str], ...] = (
    ("fusion.core_method", "str"),
    ("preprocess.core_method", "str"),  # the pre-processor's own keys are declared by its registry entry
    ("preprocess.cav_lidar_range", "list"),
    ("postprocess.anchor_args.cav_lidar_range", "list"),
    ("postprocess.order", "str"),
    ("postprocess.max_num", "positive_int"),
    # Upstream's BaseDataset always builds its DataAugmentor from this list, even where it never runs.
    ("data_augment", "list"),
)
# V2X-ViT's (and OpenCOOD's) ``wild_setting`` block: communication delay and localisation noise (data/wild.py).
# loc_err_mode is ours: how the localisation error is drawn (upstream's one reseeded offset, or per sample).
WILD_SETTING_KEYS: Tuple[Tuple[str, str], ...] = (
    ("wild_setting", "dict"),
    ("wild_setting.async", "bool"),
    ("wild_setting.async_mode", "str"),
    ("wild_setting.async_overhead", "number"),
    ("wild_setting.seed", "int"),
    ("wild_setting.loc_err", "bool"),
    ("wild_setting.loc_err_mode", "str"),
    ("wild_setting.xyz_std", "number"),
    ("wild_setting.ryp_std", "number"),
    ("wild_setting.data_size", "number"),
    ("wild_setting.transmission_speed", "number"),
    ("wild_setting.backbone_delay", "number"),
)
# HEAL's and CoAlign's localisation error, drawn per CAV and frame (the ego included).
NOISE_SETTING_KEYS: Tuple[Tuple[str, str], ...] = (
    ("noise_setting", "dict"),
    ("noise_setting.add_noise", "bool"),
    ("noise_setting.args", "dict"),
    ("noise_setting.args.pos_std", "number"),
    ("noise_setting.args.rot_std", "number"),
    ("noise_setting.args.pos_mean", "number"),
    ("noise_setting.args.rot_mean", "number"),
    ("noise_setting.args.laplace", "bool"),
)
COMMON_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = (
    ("train_params.max_cav", "positive_int"),
    # Ours: the shuffle, projection, crop and voxelization on the rank's device (data/device_points.py).
    ("preprocess.on_device", "bool"),
    ("postprocess.gt_range", "list"),
    ("fusion.args", "args"),
) + WILD_SETTING_KEYS + NOISE_SETTING_KEYS


def report_non_finite(points: np.ndarray, path: Any) -> int:
    """Say once per file, in this rank's log, how many points have a non-finite x, y or z (``tell_non_finite``).
    Returns the count."""
    finite = np.isfinite(points[:, :3])
    if finite.all():  # the usual answer, without the slow reduction along rows of 3 (0.6 against 2.1 ms)
        return 0
    bad = len(points) - int(np.count_nonzero(finite.all(axis=1)))
    tell_non_finite(path, bad, len(points))
    return bad


class PostProcessor(Protocol):
    """The three calls the datasets make of a post-processor, exactly as upstream's VoxelPostprocessor; `None` in its
    place leaves ``anchor_box`` and ``label_dict`` out of samples and batches. It must be picklable (datasets travel
    to DataLoader workers) and deterministic (no RNG)."""

    def generate_anchor_box(self) -> np.ndarray:
        """(H, W, anchor_num, 7) anchors in the GT order; called once per dataset per process and cached."""
        ...

    def generate_label(self, *, gt_box_center: np.ndarray, anchors: np.ndarray, mask: np.ndarray) -> dict:
        """gt_box_center (max_num, 7) float64 padded, anchors as above, mask (max_num,) float64 0/1 -> numpy
        arrays (upstream's: pos_equal_one (H, W, A), neg_equal_one (H, W, A), targets (H, W, 7A))."""
        ...

    def collate_batch(self, label_list: List[dict]) -> dict:
        """The per-sample label dicts -> one dict of tensors with a leading batch dimension."""
        ...


@dataclass(frozen=True)
class ReceivedCav:
    """One CAV of a sample as the ego receives it (data/wild.py; docs/robustness.md, docs/compatibility.md).

    Per kept CAV: ``time_delay`` frames of communication delay (``wild_setting.async``; 0 for the ego; clamped at
    the scenario's first frame) and the localisation error of its pose (``wild_setting.loc_err`` or HEAL's
    ``noise_setting``). As upstream, a delayed CAV's LiDAR, pose and speed come from the delayed frame and its
    ground-truth boxes from the current one; the 70 m range test compares its delayed true pose with the ego's
    current one, and ground truth is always placed with true poses. Its cloud goes into the ego frame by
    ``x1_to_x2(sent pose, ego pose)`` with the poses the ego believes: the ego's current pose, or with
    ``fusion.args.cur_ego_pose_flag: false`` (intermediate fusion) the ego's pose at the CAV's delayed frame,
    corrected by ``spatial_correction``. ``wild_setting.loc_err_mode: upstream`` (the default) reproduces
    upstream's inputs, quirks included: one fixed offset for every non-ego pose, which only upstream's
    intermediate dataset applies (``reads_upstream_loc_err``); ``v2xvit`` the V2X-ViT repository's: the same
    offset in every dataset, and late fusion's ground truth moved by the noisy current pose (``to_ego_gt``).
    ``per_sample`` and ``noise_setting`` draw per CAV and frame from generators keyed by (seed, epoch, index, CAV
    slot, frame), in every dataset. Without either
    block every CAV is read at the ego's timestamp with its true pose. Road-side units (negative folder ids) are
    read, delayed and perturbed like CAVs and are never the ego."""

    slot: int                        # its place among the scenario's kept CAVs; 0 is the ego
    sent: CavFrame                   # the frame it sent, time_delay frames back: LiDAR, pose, speed
    current: CavFrame                # the same CAV at the sample's timestamp: its vehicles are the ground truth
    time_delay: int                  # frames of 100 ms actually applied
    to_ego: np.ndarray               # (4, 4) its LiDAR frame -> the ego frame, from the poses the ego believes
    to_ego_clean: np.ndarray         # (4, 4) the same from the true poses onto the ego's current pose
    spatial_correction: np.ndarray   # (4, 4) the ego pose it was projected onto -> the ego's current pose
    noisy: bool                      # whether this dataset applies a localisation error to its projections
    # (4, 4) what late fusion moves its ground truth by: to_ego_clean, but in loc_err_mode v2xvit the V2X-ViT
    # repository's gt_transformation_matrix, x1_to_x2(its noisy current pose, the ego's current pose)
    to_ego_gt: np.ndarray

    @property
    def cav_id(self) -> str:
        return self.sent.cav_id

    @property
    def ego(self) -> bool:
        return self.slot == 0

    @property
    def infra(self) -> bool:
        return self.sent.infra


class OpencoodDataset(Dataset):
    """Base class: subclasses implement ``get_sample(index, rng)`` and their collate functions.

    Reproducibility: sample ``i`` of epoch ``e`` is a pure function of ``(seed, e, i)``. Every random decision
    (point shuffling, the late-fusion CAV choice, augmentation) draws from ``sample_rng(seed, e, i)`` in a fixed
    order, and the robustness settings' draws from generators keyed by the same triple plus the CAV and frame
    (``wild.wild_rng``), so they never shift that order. The epoch is set by ``set_epoch(e)``: the engine's
    loaders send it with every index (engine/loaders.py), so a DataLoader worker that persists over epochs sets
    its own copy. No global RNG, rank or worker id is read, so 1, 2 or N ranks with any number of workers load
    bit-identical samples."""

    required_keys: Tuple[Tuple[str, str], ...] = COMMON_KEYS
    optional_keys: Tuple[Tuple[str, str], ...] = COMMON_OPTIONAL_KEYS
    # Whether loc_err_mode upstream perturbs this dataset's projections: only upstream's intermediate dataset
    # reads the noisy transformation_matrix; its early and late datasets project with the true poses.
    reads_upstream_loc_err: bool = False
    # fusion.args.cur_ego_pose_flag false (intermediate fusion): project onto the ego's pose at the CAV's frame.
    projects_to_delayed_ego: bool = False
    # Which of sources.FUSIONS this dataset is: a source may treat them differently (V2V4Real's range test).
    fusion: str = ""

    def __init__(self, hypes: Mapping, split: str, train: bool, seed: int,
                 post_processor: Optional[PostProcessor] = None, visualize: bool = False):
        source = hypes_source(hypes)
        if split not in SPLIT_KEYS:
            raise ConfigError(f"dataset split must be one of {sorted(SPLIT_KEYS)}, got {split!r}")
        split_key = SPLIT_KEYS[split]
        # The pre-processor's keys too, so that one line names every missing key of the data side.
        pre = preprocessor_entry(hypes, source)
        validate(hypes, tuple(self.required_keys) + ((split_key, "str"),) + pre.required, source,
                 tuple(self.optional_keys) + pre.optional)
        source_entry(hypes)  # the data set's own keys (fusion.dataset), before anything is read
        self.wild = wild_setting_from_hypes(hypes, source)
        self.hypes = hypes
        self.split, self.train, self.seed, self.visualize = split, bool(train), int(seed), bool(visualize)
        self.epoch = 0
        self.post_processor = post_processor
        self._anchors: Optional[np.ndarray] = None

        self.lidar_range = range6(hypes, "preprocess.cav_lidar_range", source)
        self.gt_range = self._gt_range(hypes, source)
        self.order = hypes["postprocess"]["order"]
        if self.order not in ("hwl", "lwh"):
            raise ConfigError(f"{source}: key postprocess.order must be 'hwl' or 'lwh', got {self.order!r}; "
                              f"fix the hypes")
        self.max_num = int(hypes["postprocess"]["max_num"])
        self.max_cav = int(get_key(hypes, "train_params.max_cav", DEFAULT_MAX_CAV))
        self.voxelizer = build_preprocessor(hypes, self.train)
        refuse_beyond_memory(source, self.whole_buffers())  # before a worker allocates them
        # Under preprocess.on_device the workers hand over clouds as read and the task's move_to voxelizes them.
        self.on_device = bool(get_key(hypes, "preprocess.on_device", False))
        self.voxel_grid = voxel_grid_of(self.voxelizer, source) if self.on_device else None
        augments = self.train and self.augments(hypes) and bool(hypes["data_augment"])  # [] means none
        self.augmentor = WorldAugmentor(hypes["data_augment"]) if augments else None
        # The source raises DataError naming split_key for a missing folder or an empty split.
        self.source: SplitSource = build_source(hypes, split_key, train=self.train, seed=self.seed,
                                                max_cav=self.max_cav)
        self.comm_range = self.source.comm_range(self.fusion)

    # ----------------------------------------------------------------------------------- protocol

    def augments(self, hypes: Mapping) -> bool:
        """Whether this kind of dataset augments in training (early, late: yes; intermediate: opt-in)."""
        return True

    def whole_buffers(self) -> List[Buffer]:
        """What the hypes make a worker allocate whole (memory_fit): each sample's padded ground truth, and the
        voxelizer's buffers (the intermediate dataset adds its CAV-by-CAV transforms)."""
        buffers = [Buffer("each sample's padded ground truth (8 float64 per box)", 64 * self.max_num,
                          f"postprocess.max_num ({self.max_num})")]
        if isinstance(self.voxelizer, Voxelizer):
            voxelizer, limit = self.voxelizer, "max_voxel_train" if self.train else "max_voxel_test"
            buffers.append(Buffer("the voxelizer's voxel buffer", voxelizer.voxel_buffer_bytes(),
                                  f"preprocess.args.{limit} ({voxelizer.max_voxels}) x max_points_per_voxel "
                                  f"({voxelizer.max_points_per_voxel})", "lower them"))
            buffers.append(Buffer("the voxelizer's hash of every grid cell (int32)", voxelizer.grid_hash_bytes(),
                                  f"preprocess.args.voxel_size {list(voxelizer.voxel_size)} over "
                                  f"preprocess.cav_lidar_range ({' x '.join(map(str, voxelizer.grid_size))} "
                                  f"cells)", "make the voxels larger"))
        return buffers

    def _gt_range(self, hypes: Mapping, source: str) -> Tuple[float, ...]:
        if self.train:
            return range6(hypes, "postprocess.anchor_args.cav_lidar_range", source)
        return evaluation_gt_range(hypes, source)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's random stream (augmentation, shuffling, late fusion's CAV choice)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> "OrderedDict[str, Any]":
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples of {self.source.root}")
        return self.get_sample(index, sample_rng(self.seed, self.epoch, index))

    def get_sample(self, index: int, rng: np.random.Generator) -> "OrderedDict[str, Any]":
        raise NotImplementedError

    def sample_cost(self, index: int) -> int:
        """How much work sample ``index`` is, read from the index without opening a file: its CAVs (before the
        communication range drops any). Memory plans measure the costliest samples (engine/batch_fit.py)."""
        return self.source.sample_frames(index, self.epoch).count

    # ----------------------------------------------------------------------------------- received CAVs

    def sample_frames(self, index: int) -> Tuple[SampleFrames, List[int], SampleKey]:
        """The sample's frame reader, the applied delay of each of its CAVs (slot order) and its draw key."""
        frames = self.source.sample_frames(index, self.epoch)
        key = SampleKey(self.seed, self.epoch, index)
        return frames, sample_delays(self.wild, frames.count, frames.position, key), key

    def received_cavs(self, index: int) -> List[ReceivedCav]:
        """The sample's CAVs within the communication range (ego first), delayed and perturbed as the hypes say."""
        frames, delays, key = self.sample_frames(index)
        ego_now = frames.frame(0)
        received = []
        for slot, lag in enumerate(delays):
            if slot and not self.within_range(frames.frame(slot, lag), ego_now):
                continue
            received.append(self.receive(frames, slot, lag, key))
        return received

    def within_range(self, sent: CavFrame, ego_now: CavFrame) -> bool:
        """Upstream's range test: the CAV's sent (delayed) true pose against the ego's current true pose."""
        return self.comm_range is None or xy_distance(sent.lidar_pose, ego_now.lidar_pose) <= self.comm_range

    def receive(self, frames: SampleFrames, slot: int, lag: int, key: SampleKey) -> ReceivedCav:
        sent, ego_now = frames.frame(slot, lag), frames.frame(0)
        clean = x1_to_x2(sent.lidar_pose, ego_now.lidar_pose)
        noisy = self.wild.noise is not None and (self.wild.noise.mode != "upstream" or self.reads_upstream_loc_err)
        reference_lag = lag if self.projects_to_delayed_ego else 0
        if not noisy and reference_lag == 0:  # the plain case: bit for bit the sample without wild settings
            return ReceivedCav(slot, sent, frames.frame(slot), lag, clean, clean, np.identity(4), False, clean)
        ego_now_pose = self.believed_pose(frames, 0, 0, key, noisy)
        reference = self.believed_pose(frames, 0, reference_lag, key, noisy)
        to_ego = x1_to_x2(self.believed_pose(frames, slot, lag, key, noisy), reference)
        # Upstream's x1_to_x2(pose, pose) for a CAV read at the current frame; exactly the identity here.
        correction = np.identity(4) if reference_lag == 0 else x1_to_x2(reference, ego_now_pose)
        to_ego_gt = clean
        if noisy and self.wild.noisy_ground_truth:
            to_ego_gt = x1_to_x2(self.believed_pose(frames, slot, 0, key, noisy), ego_now_pose)
        return ReceivedCav(slot, sent, frames.frame(slot), lag, to_ego, clean, correction, noisy, to_ego_gt)

    def believed_pose(self, frames: SampleFrames, slot: int, lag: int, key: SampleKey, noisy: bool) -> np.ndarray:
        """CAV ``slot``'s pose ``lag`` frames back, with its localisation error when ``noisy``."""
        pose = frames.frame(slot, lag).lidar_pose
        offset = pose_offset(self.wild, slot, lag, key) if noisy else None
        return pose if offset is None else perturb(pose, offset)

    # ----------------------------------------------------------------------------------- points

    def load_cav_points(self, frame: CavFrame, rng: np.random.Generator) -> np.ndarray:
        """One CAV's cloud, read once, shuffled with the sample's RNG and without the car's own hits."""
        points = self.source.points(frame)
        report_non_finite(points, frame.pcd_path)
        return mask_ego_points(shuffle_points(points, rng))

    def crop(self, points: np.ndarray) -> np.ndarray:
        return mask_points_by_range(points, self.lidar_range)

    def raw_cloud(self, frame: CavFrame, slot: int, index: int, to_ego: Optional[np.ndarray] = None,
                  transform: Optional[WorldTransform] = None) -> RawCloud:
        """One CAV's cloud as read, with the projection, augmentation and shuffle key the device applies
        (``preprocess.on_device``; data/device_points.py)."""
        operations = transform.operations if transform is not None else ()
        points, colour_bits = self.source.stored_points(frame)
        return RawCloud(points, shuffle_key(self.seed, self.epoch, index, slot), str(frame.pcd_path), to_ego,
                        operations, colour_bits)

    def raw_lidar(self, clouds: List[RawCloud], separate: bool, crop_first: bool = False) -> RawLidar:
        """A sample's ``processed_lidar`` under ``preprocess.on_device``: each cloud voxelized on its own (``separate``)
        or all together."""
        return RawLidar(clouds, self.voxel_grid, separate, crop_first)

    def clouds_are_binary(self) -> bool:
        """Whether the split's clouds are binary .pcd, judged by the first sample's ego cloud (a data set is
        converted whole, tools/convert_pcd.py): what a loader worker's cost per sample hangs on."""
        return read_pcd_header(self.source.sample_frames(0, self.epoch).frame(0).pcd_path).data != "ascii"

    def picture_points(self, cloud: RawCloud, crop_first: bool = False) -> np.ndarray:
        """A raw cloud's points as the CPU path leaves them, in the file's order: pictures and --save_npy under
        ``preprocess.on_device`` (the same points as the device keeps, not shuffled)."""
        points = mask_ego_points(cloud.decoded())
        if cloud.to_ego is not None:
            points = transform_points(points, cloud.to_ego)
        if crop_first:
            points = self.crop(points)
        points = WorldTransform(cloud.augment).points(points) if cloud.augment else points
        return points if crop_first else self.crop(points)

    # ----------------------------------------------------------------------------------- ground truth

    def cav_objects(self, cav: CavFrame, target_pose: np.ndarray) -> Objects:
        """(K, 7) boxes one CAV contributes to the sample's ground truth, in the frame of ``target_pose``, filtered by
        the GT range (``sources``: each data set's labels)."""
        return self.source.objects(cav, target_pose, self.gt_range)

    def merge_objects(self, per_cav: Iterable[Objects]) -> Objects:
        """The sample's ground truth from its CAVs' boxes (OPV2V: repeated ids dropped, the first CAV's box kept)."""
        return self.source.merge(list(per_cav))

    def sample_objects(self, cavs: Sequence[ReceivedCav]) -> Objects:
        """The sample's ground truth in the ego's current true frame, from the CAVs' current frames; where the
        source's labels follow the points (V2V4Real's fork), each CAV's current labels mapped with ``to_ego``.

        As upstream: each CAV's ``vehicles`` (world frame) are projected into the target frame (the ego's, or the
        CAV's own in late fusion) and kept when all 8 corners lie inside the GT range: in training
        ``postprocess.anchor_args.cav_lidar_range``; otherwise upstream's fixed ``GT_RANGE`` [-140, -40, -3, 140,
        40, 1] (our optional ``postprocess.gt_range`` replaces it). Boxes are ``[x, y, z, h, w, l, yaw]`` for
        ``order: hwl``. An object seen by several CAVs is kept once, by id, the first CAV's box, in upstream's
        order ``[ids.index(x) for x in set(ids)]`` (for integer ids CPython's set order depends only on the values,
        so it is the same in every process; other ids are taken in sorted order, string hashes being salted)."""
        if self.source.labels_follow_points:
            return self.merge_objects(self.source.objects_through(cav.current, cav.to_ego, self.gt_range)
                                      for cav in cavs)
        ego_pose = cavs[0].current.lidar_pose
        return self.merge_objects(self.cav_objects(cav.current, ego_pose) for cav in cavs)

    def pad_objects(self, boxes: np.ndarray, where: Any) -> Tuple[np.ndarray, np.ndarray]:
        """(max_num, 7) float64 boxes and (max_num,) float64 mask, as upstream; more objects than
        ``postprocess.max_num`` is a DataError (upstream fails with a shape error)."""
        if len(boxes) > self.max_num:
            raise DataError(f"{where}: {len(boxes)} ground-truth objects exceed postprocess.max_num "
                            f"{self.max_num}; raise postprocess.max_num in the hypes")
        center = np.zeros((self.max_num, 7), dtype=np.float64)
        mask = np.zeros(self.max_num, dtype=np.float64)
        center[:len(boxes)] = boxes
        mask[:len(boxes)] = 1
        return center, mask

    def in_range_boxes(self, boxes: np.ndarray, ids: List) -> Tuple[np.ndarray, List]:
        """Boxes whose corners lie inside cav_lidar_range (upstream re-filters after augmentation): all 8, or the
        source's ``min_corners`` (V2V4Real: 2)."""
        corners = self.source.min_corners
        keep = boxes_in_range_mask(boxes_to_corners(boxes, self.order), self.lidar_range, corners) if len(boxes) \
            else np.zeros(0, dtype=bool)
        return boxes[keep], [i for i, k in zip(ids, keep) if k]

    def sample_transform(self, rng: np.random.Generator) -> Optional[WorldTransform]:
        """The sample's augmentation, or None when this dataset does not augment."""
        return self.augmentor.sample(rng) if self.augmentor is not None else None

    # ----------------------------------------------------------------------------------- labels

    def anchors(self) -> Optional[np.ndarray]:
        if self.post_processor is None:
            return None
        if self._anchors is None:
            self._anchors = self.post_processor.generate_anchor_box()
        return self._anchors

    def label_entries(self, center: np.ndarray, mask: np.ndarray) -> Dict[str, Any]:
        """{'anchor_box', 'label_dict'} from the post-processor, or {} without one. Under ``preprocess.on_device``
        the labels by index where the post-processor can give them (``generate_sparse_label``): the task's move_to
        spreads them on the device."""
        if self.post_processor is None:
            return {}
        anchors = self.anchors()
        sparse = getattr(self.post_processor, "generate_sparse_label", None) if self.on_device else None
        label = (sparse or self.post_processor.generate_label)(gt_box_center=center, anchors=anchors, mask=mask)
        return {"anchor_box": anchors, "label_dict": label}

    def collate_labels(self, samples: Sequence[Mapping]) -> Dict[str, Any]:
        if self.post_processor is None:
            return {}
        return {"label_dict": self.post_processor.collate_batch([s["label_dict"] for s in samples])}

    # ----------------------------------------------------------------------------------- collate

    @staticmethod
    def stack_objects(samples: Sequence[Mapping]) -> Dict[str, torch.Tensor]:
        """(B, max_num, 7) boxes and (B, max_num) masks, float64 as upstream."""
        return {"object_bbx_center": torch.from_numpy(np.array([s["object_bbx_center"] for s in samples])),
                "object_bbx_mask": torch.from_numpy(np.array([s["object_bbx_mask"] for s in samples]))}

    def collate_batch_train(self, batch: Sequence[Mapping]) -> Dict[str, Dict[str, Any]]:
        """Early and late fusion training (and validation-loss) batches: only each sample's 'ego' entry."""
        egos = [sample["ego"] for sample in batch]
        ego: Dict[str, Any] = dict(self.stack_objects(egos))
        ego["processed_lidar"] = collate_lidar([e["processed_lidar"] for e in egos])
        ego.update(self.collate_labels(egos))
        return {"ego": ego}

    @staticmethod
    def test_extras(sample: Mapping) -> Dict[str, torch.Tensor]:
        """A one-sample test batch's anchor_box, origin_lidar and cav_positions (batch dimension 1), when the
        sample has them."""
        extras: Dict[str, torch.Tensor] = {}
        if "anchor_box" in sample:
            extras["anchor_box"] = torch.from_numpy(np.array(sample["anchor_box"]))
        if "origin_lidar" in sample:
            extras["origin_lidar"] = torch.from_numpy(sample["origin_lidar"][None])
        if "cav_positions" in sample:
            extras["cav_positions"] = torch.from_numpy(sample["cav_positions"][None])
        return extras

    @staticmethod
    def require_single(batch: Sequence, kind: str) -> None:
        if len(batch) != 1:
            raise ConfigError(f"{kind} evaluation batches hold exactly one sample (upstream's collate_batch_test), "
                              f"got {len(batch)}; run inference with batch size 1")


def collate_lidar(entries: Sequence[Any]) -> Any:
    """Samples' ``processed_lidar`` -> the batch's: voxels concatenated (``collate_voxels``), or under
    ``preprocess.on_device`` the clouds packed for the device (``collate_raw``)."""
    if entries and isinstance(entries[0], RawLidar):
        return collate_raw(entries)
    return collate_voxels(entries)


def cav_positions(to_ego: Sequence[np.ndarray]) -> np.ndarray:
    """(K, 3) float32 LiDAR origins of the frame's CAVs in the ego frame (ego first): our key, for pictures."""
    return np.array([matrix[:3, 3] for matrix in to_ego], dtype=np.float32).reshape(-1, 3)


def identity_matrix() -> torch.Tensor:
    """The ego's transformation matrix in test batches: float32 identity (4, 4), as upstream."""
    return torch.from_numpy(np.identity(4)).float()
