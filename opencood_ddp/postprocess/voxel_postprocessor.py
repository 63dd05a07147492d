"""The anchor-based post-processor of the PointPillar family: anchors, labels, and boxes from head outputs.

Upstream counterpart: ``VoxelPostprocessor`` (``opencood/data_utils/post_processor/voxel_postprocessor.py``)
with ``BasePostprocessor.generate_gt_bbx``. The datasets call ``generate_anchor_box``, ``generate_label`` and
``collate_batch`` (the interface documented in ``opencood_ddp.data.datasets.base``); evaluation calls
``post_process`` and ``generate_gt_bbx`` on one-sample test batches.

Reads ``postprocess.anchor_args`` (cav_lidar_range, l, w, h, r, num, optional feature_stride, and W, H, vw,
vh written by the yaml_parser), ``target_args`` (pos_threshold, neg_threshold, score_threshold), ``order``
('hwl' only: upstream's label generation supports nothing else), ``nms_thresh`` and our optional
``gt_range`` (the evaluation range; absent, upstream's fixed GT_RANGE).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from opencood_ddp.data.ground_truth import evaluation_gt_range, upstream_unique_indices
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import HYPES_FIX, get_key, range6, validate
from opencood_ddp.postprocess import box_coder
from opencood_ddp.postprocess.anchors import AnchorSpec, generate_anchors
from opencood_ddp.postprocess.direction import (DirectionArgs, apply_direction, check_direction_agreement,
                                                direction_logits, direction_targets)
from opencood_ddp.postprocess.boxes import (boxes_to_corners, normal_size_mask, normal_z_mask, project_corners,
                                            within_range_mask)
from opencood_ddp.postprocess.nms import nms_rotated
from opencood_ddp.postprocess.sparse_labels import SparseLabelBatch, SparseLabels
from opencood_ddp.postprocess.targets import LABEL_DTYPE, Assignment, StandupGrid, assign, dense_labels
from opencood_ddp.registry import POSTPROCESSORS

# W, H, vw, vh are written by the yaml_parser: required here, but declared optional to the registry so that
# their absence gets check_postprocess_hypes' hint ("add yaml_parser: ...") rather than a bare missing key.
REQUIRED_KEYS: Tuple[Tuple[str, str], ...] = (
    ("postprocess.anchor_args.cav_lidar_range", "list"),
    ("postprocess.anchor_args.l", "positive_number"),  # box sizes: the targets are log(size / anchor size)
    ("postprocess.anchor_args.w", "positive_number"),
    ("postprocess.anchor_args.h", "positive_number"),
    ("postprocess.anchor_args.r", "list"),
    ("postprocess.anchor_args.num", "positive_int"),
    ("postprocess.anchor_args.W", "positive_int"),
    ("postprocess.anchor_args.H", "positive_int"),
    ("postprocess.anchor_args.vw", "number"),
    ("postprocess.anchor_args.vh", "number"),
    ("postprocess.target_args.pos_threshold", "number"),
    ("postprocess.target_args.neg_threshold", "number"),
    ("postprocess.target_args.score_threshold", "number"),
    ("postprocess.order", "str"),
    ("postprocess.nms_thresh", "number"),
)
OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = (
    ("postprocess.anchor_args.feature_stride", "positive_int"),
    ("postprocess.gt_range", "list"),
    ("postprocess.dir_args", "dict"),  # the direction classifier's decoding (postprocess/direction.py)
)
_PARSER_KEYS = ("W", "H", "vw", "vh")
FLOAT_LABELS = ("targets", "pos_equal_one", "neg_equal_one")


def _fail(source: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: {message}; {HYPES_FIX}")


def check_postprocess_hypes(postprocess: Mapping, source: str) -> None:
    """Raise one ConfigError naming the first problem of ``postprocess`` (keys written as ``postprocess.*``)."""
    anchor_args = get_key({"postprocess": postprocess}, "postprocess.anchor_args")
    if isinstance(anchor_args, Mapping) and not any(k in anchor_args for k in _PARSER_KEYS):
        raise ConfigError(f"{source}: keys postprocess.anchor_args.W, H, vw, vh are missing; they are written by "
                          f"the yaml_parser: add 'yaml_parser: load_point_pillar_params' to the hypes")
    validate({"postprocess": postprocess}, REQUIRED_KEYS, source, OPTIONAL_KEYS)
    if postprocess["order"] != "hwl":
        raise _fail(source, f"key postprocess.order must be 'hwl' for VoxelPostprocessor (upstream's label "
                            f"generation supports only 'hwl'), got {postprocess['order']!r}")
    for key in ("target_args.pos_threshold", "target_args.neg_threshold", "nms_thresh"):
        value = get_key(postprocess, key)
        if not 0 <= value <= 1:
            raise _fail(source, f"key postprocess.{key} must be an IoU in [0, 1], got {value!r}")
    targets = postprocess["target_args"]
    if not 0 <= targets["score_threshold"] <= 1:
        raise _fail(source, f"key postprocess.target_args.score_threshold must be a score in [0, 1] (a sigmoid's), "
                            f"got {targets['score_threshold']!r}")
    if targets["pos_threshold"] < targets["neg_threshold"]:
        # an anchor with an IoU between the two would be labelled positive and negative at once
        raise _fail(source, f"key postprocess.target_args.pos_threshold ({targets['pos_threshold']}) must not be "
                            f"below postprocess.target_args.neg_threshold ({targets['neg_threshold']})")
    args = postprocess["anchor_args"]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in args["r"]):
        raise _fail(source, f"key postprocess.anchor_args.r must be a list of yaw angles in degrees, got {args['r']!r}")
    if args["num"] != len(args["r"]):
        raise _fail(source, f"key postprocess.anchor_args.num ({args['num']}) must equal the number of yaws in "
                            f"postprocess.anchor_args.r ({args['r']!r})")
    range6({"postprocess": postprocess}, "postprocess.anchor_args.cav_lidar_range", source)
    evaluation_gt_range({"postprocess": postprocess}, source)
    if postprocess.get("dir_args") is not None:
        DirectionArgs.read(postprocess["dir_args"], "postprocess.dir_args", source)
    spec = AnchorSpec.from_anchor_args(args)
    if min(spec.feature_shape) < 1:
        raise _fail(source, f"the BEV grid {spec.grid_w} x {spec.grid_h} (postprocess.anchor_args.W, H) is smaller "
                            f"than postprocess.anchor_args.feature_stride {spec.feature_stride}")


def _empty_detections(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros((0, 8, 3), dtype=torch.float32, device=device),
            torch.zeros((0,), dtype=torch.float32, device=device))


def _require_single(tensor: torch.Tensor, what: str, cav_id: Hashable) -> None:
    if tensor.shape[0] != 1:
        raise ValueError(f"{what} of CAV {cav_id!r} has batch size {tensor.shape[0]}; post-processing takes "
                         f"one-sample test batches (upstream asserts batch size 1)")


_PARSER_WRITTEN = tuple(spec for spec in REQUIRED_KEYS if spec[0].rsplit(".", 1)[1] in _PARSER_KEYS)


@POSTPROCESSORS.register("VoxelPostprocessor",
                         required=tuple(spec for spec in REQUIRED_KEYS if spec not in _PARSER_WRITTEN),
                         optional=OPTIONAL_KEYS + _PARSER_WRITTEN,
                         check=lambda hypes, source: (check_postprocess_hypes(hypes["postprocess"], source),
                                                      check_direction_agreement(hypes, source)))
class VoxelPostprocessor:
    """Anchors, training labels and detections for anchor-based BEV heads (upstream's VoxelPostprocessor).

    Picklable (plain attributes; datasets carry it into DataLoader workers) and deterministic (no RNG).
    """

    delta_to_boxes3d = staticmethod(box_coder.delta_to_boxes3d)

    def __init__(self, postprocess_hypes: Mapping, train: bool, source: str = "hypes"):
        check_postprocess_hypes(postprocess_hypes, source)
        self.params: Dict[str, Any] = copy.deepcopy(dict(postprocess_hypes))
        self.train = bool(train)
        self.order: str = self.params["order"]
        self.anchor_spec = AnchorSpec.from_anchor_args(self.params["anchor_args"])
        self.anchor_num = int(self.params["anchor_args"]["num"])
        target_args = self.params["target_args"]
        self.pos_threshold = float(target_args["pos_threshold"])
        self.neg_threshold = float(target_args["neg_threshold"])
        self.score_threshold = float(target_args["score_threshold"])
        self.nms_thresh = float(self.params["nms_thresh"])
        self.gt_range: Tuple[float, ...] = evaluation_gt_range({"postprocess": self.params}, source)
        direction = self.params.get("dir_args")
        self.direction = None if direction is None else DirectionArgs.read(direction, "postprocess.dir_args", source)
        # (anchors, their StandupGrid) of the last generate_label call; the datasets pass one cached array.
        self._standup_cache: Optional[Tuple[np.ndarray, StandupGrid]] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_standup_cache"] = None  # workers rebuild it; no need to ship a few MB per copy
        return state

    # ----------------------------------------------------------------------------------- dataset side

    def generate_anchor_box(self) -> np.ndarray:
        """(H, W, anchor_num, 7) float64 anchors, 'hwl' (see ``anchors``)."""
        return generate_anchors(self.anchor_spec, self.order)

    def generate_label(self, *, gt_box_center: np.ndarray, anchors: np.ndarray,
                       mask: np.ndarray) -> Dict[str, np.ndarray]:
        """pos_equal_one, neg_equal_one (H, W, A) and targets (H, W, 7A), float32 (``LABEL_DTYPE``; upstream's
        values, the residuals computed in float64 and rounded once, see ``targets``); with ``dir_args`` also
        dir_targets (H, W, A) int64 (``direction``)."""
        assignment = self.assignment(gt_box_center, anchors, mask)
        if self.direction is None:
            return dense_labels(assignment, LABEL_DTYPE)
        # The sectors read the float64 yaw residuals (a heading within float32 rounding of a sector boundary
        # would otherwise change sector): the labels are made in float64 and rounded after them.
        labels = dense_labels(assignment, np.float64)
        labels["dir_targets"] = direction_targets(labels["targets"], self.direction)
        return {key: value.astype(LABEL_DTYPE) if key in FLOAT_LABELS else value for key, value in labels.items()}

    def generate_sparse_label(self, *, gt_box_center: np.ndarray, anchors: np.ndarray,
                              mask: np.ndarray) -> SparseLabels:
        """The labels of ``generate_label`` by index, for the device to spread (``preprocess.on_device``;
        ``sparse_labels``)."""
        return SparseLabels.of(self.assignment(gt_box_center, anchors, mask), self.direction)

    def assignment(self, gt_box_center: np.ndarray, anchors: np.ndarray, mask: np.ndarray) -> Assignment:
        """Upstream's target rules on the valid rows of the padded boxes (``targets.assign``)."""
        gt = np.asarray(gt_box_center, dtype=np.float64).reshape(-1, 7)
        valid = gt[np.asarray(mask).reshape(-1) == 1]
        return assign(valid, anchors, self.pos_threshold, self.neg_threshold, self.anchor_standup(anchors))

    def anchor_standup(self, anchors: np.ndarray) -> StandupGrid:
        """The standup boxes of ``anchors`` and their grid bounds, made once per anchor array (anchors are never
        modified in place)."""
        if self._standup_cache is None or self._standup_cache[0] is not anchors:
            self._standup_cache = (anchors, StandupGrid.of(anchors))
        return self._standup_cache[1]

    @staticmethod
    def collate_batch(label_list: Sequence[Any]) -> Any:
        """Per-sample label dicts -> {'targets', 'pos_equal_one', 'neg_equal_one'[, 'dir_targets']} with a batch
        dimension; the float labels in ``LABEL_DTYPE`` whatever dtype they come in. ``SparseLabels`` ->
        ``SparseLabelBatch``, which the task's ``move_to`` turns into the same dict on the device."""
        if isinstance(label_list[0], SparseLabels):
            return SparseLabelBatch.collate(label_list)
        batch = {key: np.stack([label[key] for label in label_list])
                 for key in FLOAT_LABELS + ("dir_targets",) if key in label_list[0]}
        return {key: torch.from_numpy(value.astype(LABEL_DTYPE, copy=False) if key in FLOAT_LABELS else value)
                for key, value in batch.items()}

    # ----------------------------------------------------------------------------------- evaluation side

    def cav_detections(self, cav_id: Hashable, cav: Mapping[str, Any],
                       output: Mapping[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One CAV's boxes above the score threshold as float32 corners in the ego frame, and their scores."""
        psm, rm = output["psm"], output["rm"]
        _require_single(psm, "psm", cav_id)
        _require_single(rm, "rm", cav_id)
        # (1, A, H, W) -> (H * W * A,): the anchors' (H, W, A) order, as the decoded boxes.
        prob = torch.sigmoid(psm.float().permute(0, 2, 3, 1)).reshape(-1)
        boxes = self.delta_to_boxes3d(rm, cav["anchor_box"])[0]
        if prob.shape[0] != boxes.shape[0]:
            raise ValueError(f"CAV {cav_id!r}: psm {tuple(psm.shape)} gives {prob.shape[0]} scores for "
                             f"{boxes.shape[0]} anchors; the head's anchor_number and postprocess.anchor_args.num "
                             f"disagree")
        if self.direction is not None:  # the heading's sector from the direction head (CoAlign's decoding)
            logits = direction_logits(output["dm"].float(), self.direction.num_bins)[0]
            boxes = torch.cat([boxes[:, :6], apply_direction(boxes[:, 6], logits, self.direction)[:, None]], dim=1)
        keep = prob > self.score_threshold  # strict, as upstream's torch.gt
        boxes, scores = boxes[keep], prob[keep]
        corners = project_corners(boxes_to_corners(boxes, self.order), cav["transformation_matrix"])
        return corners, scores

    def post_process(self, data_dict: Mapping[Hashable, Mapping[str, Any]],
                     output_dict: Mapping[Hashable, Mapping[str, torch.Tensor]]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Detections of one test sample in the ego frame: (N, 8, 3) float32 corners and (N,) scores.

        As upstream: per CAV (``'ego'`` and, in late fusion, the other CAV ids), sigmoid scores above
        ``score_threshold``, boxes decoded from their anchors and projected by the CAV's
        ``transformation_matrix``; then all CAVs together (late fusion's merge): boxes larger than 6 m or with
        corners outside z [-3, 1] dropped, rotated NMS at ``nms_thresh``, boxes not inside the GT range
        dropped. Departure: where upstream returns ``(None, None)`` (no box above the threshold), this
        returns empty tensors of shapes (0, 8, 3) and (0,).
        """
        corners_list: List[torch.Tensor] = []
        scores_list: List[torch.Tensor] = []
        for cav_id, cav in data_dict.items():
            if cav_id not in output_dict:
                raise ValueError(f"the model output has no entry for CAV {cav_id!r} "
                                 f"(outputs for {list(output_dict)})")
            corners, scores = self.cav_detections(cav_id, cav, output_dict[cav_id])
            if len(scores):
                corners_list.append(corners)
                scores_list.append(scores)
        if not corners_list:
            device = next((out["psm"].device for out in output_dict.values()), torch.device("cpu"))
            return _empty_detections(device)
        corners, scores = torch.cat(corners_list), torch.cat(scores_list)
        keep = normal_size_mask(corners) & normal_z_mask(corners)
        corners, scores = corners[keep], scores[keep]
        keep = nms_rotated(corners, scores, self.nms_thresh)
        corners, scores = corners[keep], scores[keep]
        in_range = within_range_mask(corners, self.gt_range)
        return corners[in_range], scores[in_range]

    def generate_gt_bbx(self, data_dict: Mapping[Hashable, Mapping[str, Any]]) -> torch.Tensor:
        """(M, 8, 3) float32 GT corners in the ego frame, each object once, inside the GT range.

        As upstream ``BasePostprocessor.generate_gt_bbx``: every CAV's valid boxes projected by its
        ``transformation_matrix``; an object id seen by several CAVs keeps its first CAV's box (CAV order,
        ego first), in upstream's id order (``upstream_unique_indices``). Corners are computed and projected
        in float64, then rounded to float32 (upstream rounds the corners to float32 first). A CAV entry with a
        ``transformation_matrix_clean`` (late fusion under pose noise) is projected by that one, so that the
        ground truth stays where the objects are (HEAL/CoAlign's rule). An ego entry that carries the sample's own
        ground truth (``gt_object_bbx_center``, already in the ego frame: late fusion on DAIR-V2X-C, whose CAVs'
        labels do not share ids) is that ground truth, range-filtered alike; given as corners
        (``gt_object_bbx_corners``: DAIR-V2X-C's ``dair_late_gt: by_iou``, HEAL's tilted corners) it is taken as
        it is, rounded to float32.
        """
        ego = data_dict.get("ego", {})
        if "gt_object_bbx_corners" in ego:
            corners, mask = ego["gt_object_bbx_corners"], ego["gt_object_bbx_mask"]
            _require_single(corners, "gt_object_bbx_corners", "ego")
            corners = corners[0][mask[0] == 1].float()
            return corners[within_range_mask(corners, self.gt_range)]
        if "gt_object_bbx_center" in ego:
            center, mask = ego["gt_object_bbx_center"], ego["gt_object_bbx_mask"]
            _require_single(center, "gt_object_bbx_center", "ego")
            corners = boxes_to_corners(center[0][mask[0] == 1].double(), self.order).float()
            return corners[within_range_mask(corners, self.gt_range)]
        corners_list: List[torch.Tensor] = []
        ids: List[Hashable] = []
        device = torch.device("cpu")
        for cav_id, cav in data_dict.items():
            center, mask = cav["object_bbx_center"], cav["object_bbx_mask"]
            _require_single(center, "object_bbx_center", cav_id)
            device = center.device
            boxes = center[0][mask[0] == 1].double()
            cav_ids = list(cav["object_ids"])
            if len(cav_ids) != len(boxes):
                raise ValueError(f"CAV {cav_id!r}: {len(cav_ids)} object_ids for {len(boxes)} masked boxes")
            corners_list.append(project_corners(boxes_to_corners(boxes, self.order),
                                                torch.as_tensor(cav.get("transformation_matrix_clean",
                                                                        cav["transformation_matrix"]))))
            ids.extend(cav_ids)
        if not corners_list:
            return torch.zeros((0, 8, 3), dtype=torch.float32, device=device)
        corners = torch.cat(corners_list).float()
        corners = corners[torch.as_tensor(upstream_unique_indices(ids), dtype=torch.long, device=corners.device)]
        return corners[within_range_mask(corners, self.gt_range)]


__all__ = ["REQUIRED_KEYS", "OPTIONAL_KEYS", "LABEL_DTYPE", "FLOAT_LABELS", "VoxelPostprocessor",
           "check_postprocess_hypes"]
