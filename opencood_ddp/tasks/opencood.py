"""The OpenCOOD perception task: fusion datasets + PointPillar model + point_pillar_loss, from one hypes file.

This is where the perception stack meets the engine's ``Task`` protocol (``opencood_ddp/engine/task.py``):

- training samples come from ``root_dir`` with training behaviour (augmentation, ``max_voxel_train``);
- the validation loss is computed on ``validate_dir`` with ``train=False``, as upstream's train.py does;
- one step runs the model on the batch's ``ego`` dict and the loss against its ``label_dict``; the loss is a
  mean over the local batch's samples, so DDP's gradient average equals the 1-process gradient;
- evaluation (``build_eval``, its flags ``EVAL_OPTIONS``) hands the engine a ``DetectionEvaluator``: the
  test-time post-processor (GT range, NMS) frame by frame on upstream's one-frame test batches (the model may run
  on several frames at once), --save_npy / --save_vis files per frame, the metric of the AP convention that
  --eval_preset picks (``tasks/eval_presets.py``; ``metrics/summary.py``), the --pr_plot curves and the report.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from opencood_ddp.data.datasets import NO_FUSION, SPLIT_KEYS, build_dataset, fusion_methods
from opencood_ddp.data.device_points import prepare_batch
from opencood_ddp.data.ground_truth import evaluation_gt_range
from opencood_ddp.data.sources import check_split_path
from opencood_ddp.data.wild import delay_frames, wild_setting_from_hypes
from opencood_ddp.engine.evaluator import EvalRequest, EvalResult, EvalSpec
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.task import LossOutput, Task
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key, hypes_source
from opencood_ddp.loss import create_loss
from opencood_ddp.metrics import FrameStats, frame_stats, pr_curve
from opencood_ddp.metrics.communication import MeteredFrameStats
from opencood_ddp.models import COMMON_OPTIONAL_KEYS as MODEL_COMMON_KEYS, create_model
from opencood_ddp.models.modules.v2xvit_encoder import DELAY_TABLE_SIZE, shorter_delay
from opencood_ddp.models.parameter_use import take_parameter_use
from opencood_ddp.postprocess import create_postprocessor
from opencood_ddp.postprocess.voxel_postprocessor import VoxelPostprocessor
from opencood_ddp.registry import import_modules
from opencood_ddp.schema import check_known_keys, named_unknown_keys
from opencood_ddp.tasks.communication import CommunicationMeter
from opencood_ddp.tasks.eval_presets import (DEFAULT_PRESET, PRESETS, EvalConvention, band_rows, eval_convention,
                                             result_suffix)

if TYPE_CHECKING:
    from opencood_ddp.vis.export import FrameExporter
# opencood_ddp.vis is imported where a picture or file is made: it brings matplotlib (0.44 s per process, measured
# with -X importtime), which a training process and most evaluations never use.


class DetectionStep:
    """``step(model, batch)``: forward on ``batch['ego']``, loss against its labels (picklable, no state).

    A model's scalar (0-d tensor) outputs, such as Where2comm's ``comm_rate``, join the loss parts: the loop
    all-reduces them with the losses, so train_steps.csv, TensorBoard and the epoch line show their sample-weighted
    means over all ranks, the same at every world size. They are logged, never backpropagated."""

    def __init__(self, loss: nn.Module):
        self.loss = loss

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        ego = batch["ego"]
        output = model(ego)
        terms = self.loss(output, ego["label_dict"])
        parts = dict(terms.parts)
        parts.update(logged_outputs(output, taken=parts))
        return LossOutput(total=terms.total, parts=parts)


def logged_outputs(output: Mapping[str, Any], taken: Mapping[str, Any]) -> dict:
    """The model output's 0-d tensors, detached, except names the loss parts already use."""
    return {name: value.detach().float() for name, value in output.items()
            if isinstance(value, torch.Tensor) and value.dim() == 0 and name not in taken and name != "loss"}


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Samples in a training or validation batch (not CAVs: record_len groups those)."""
    return int(batch["ego"]["object_bbx_center"].shape[0])


# Loader workers per GPU rank under preprocess.on_device with binary clouds. A worker spends 12.8 ms of CPU a
# sample there (12.0-15.8 over 3 runs; docs/benchmarks.md, "What a worker does per sample": about 78 samples/s a
# core), and the fastest baseline step on an H200 (the full-size AttFuse, batch 2) trains 82 samples/s: 2 workers
# feed it, 4 leave twice that for slower cores and costlier samples. Otherwise (72-139 ms a sample) the engine's
# rule: the cores, up to 8.
DEVICE_PATH_WORKERS = 4


def gpu_workers(dataset: Any) -> Optional[int]:
    """Task.gpu_workers of a dataset: DEVICE_PATH_WORKERS where its workers only read binary clouds."""
    return DEVICE_PATH_WORKERS if dataset.on_device and dataset.clouds_are_binary() else None


# The task's keys besides the registry entries': the split folders and the models' common extensions.
TASK_KEYS = tuple((key, "str") for key in SPLIT_KEYS.values()) + tuple(MODEL_COMMON_KEYS)


def check_delay_table(hypes: Mapping) -> None:
    """V2X-ViT encodes each CAV's delay as a row of a 100-row table (delay frames x RTE_ratio): a wild_setting delay
    past it failed in the forward, on the ranks whose samples met it, while the others waited. Refused at build,
    on every rank, from the longest delay the setting can draw."""
    encoder = get_key(hypes, "model.args.transformer.encoder.cav_att_config")
    if not isinstance(encoder, Mapping) or not encoder.get("use_RTE"):
        return
    delay = wild_setting_from_hypes(hypes, hypes_source(hypes)).delay
    if not delay.enabled:
        return
    longest = delay_frames(delay, ego=False, overhead_draw=math.nextafter(delay.overhead_ms, 0.0))
    ratio = int(encoder["RTE_ratio"])
    if longest * ratio >= DELAY_TABLE_SIZE:
        raise ConfigError(f"{hypes_source(hypes)}: wild_setting's delay reaches {longest} frames, past V2X-ViT's "
                          f"delay table ({DELAY_TABLE_SIZE} rows at RTE_ratio {ratio}); {shorter_delay(ratio)}")


def build_task(hypes: dict, for_training: bool) -> Task:
    import_modules(hypes, hypes_source(hypes))  # every rank, before anything is built (a no-op once done)
    check_delay_table(hypes)
    if for_training:  # a mistyped key of a new or resumed run; evaluation reads the run's own config.yaml
        check_known_keys(hypes, hypes_source(hypes), extra=TASK_KEYS)
    seed = int(hypes.get("train_params", {}).get("seed", 0))
    train_post = create_postprocessor(hypes, train=True)
    train_set = build_dataset(hypes, "train", train=True, seed=seed, post_processor=train_post) \
        if for_training else None
    val_set = build_dataset(hypes, "validate", train=False, seed=seed, post_processor=train_post)
    model = create_model(hypes)
    return Task(train_set=train_set, val_set=val_set,
                collate_train=train_set.collate_batch_train if train_set is not None else None,
                collate_val=val_set.collate_batch_train, model=model, step=DetectionStep(create_loss(hypes)),
                batch_size_of=batch_size_of, move_to=prepare_batch, parameter_use=take_parameter_use,
                gpu_workers=gpu_workers(train_set if train_set is not None else val_set))


# ------------------------------------------------------------------------------------------------ evaluation
class EvalCollate:
    """Test batches: ``frames``, one upstream test batch (``collate_batch_test``) per frame, for post-processing,
    GT and pictures; and ``model_input``, the frame itself when alone, else the frames stacked by the training
    collate so that the model runs once per batch (early and intermediate fusion; eval-mode BatchNorm makes
    each frame's output independent of its batch). Frames beside a stacked input carry no ``processed_lidar``:
    only the model reads it, so it is neither handed over twice nor, under ``preprocess.on_device``, voxelized twice."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __call__(self, samples: List[Mapping]) -> Dict[str, Any]:
        frames = [self.dataset.collate_batch_test([sample]) for sample in samples]
        if len(samples) == 1:
            return {"frames": frames, "model_input": frames[0]}
        for frame in frames:
            frame["ego"].pop("processed_lidar", None)
        return {"frames": frames, "model_input": self.dataset.collate_batch_train(samples)}


class FrameEvaluator:
    """One test batch -> one FrameStats per frame: model, post-processing, the convention's detections, TP/FP
    per IoU (and per distance band where the convention has bands), optional files."""

    def __init__(self, post: VoxelPostprocessor, fusion_method: str, exporter: Optional[FrameExporter] = None,
                 meter: Optional[CommunicationMeter] = None, convention: EvalConvention = EvalConvention()):
        self.post, self.fusion_method, self.exporter, self.meter = post, fusion_method, exporter, meter
        self.convention = convention

    def outputs(self, model: nn.Module, model_input: Mapping[str, Any], frames: int) -> List[Dict[str, Any]]:
        """The model's output dict per frame, keyed like the frame's test batch (no fusion: the ego's alone)."""
        if self.fusion_method == "late":  # every CAV detects in its own frame; one frame per batch
            return [{cav: model(entry) for cav, entry in model_input.items()}]
        if self.fusion_method == NO_FUSION:  # the ego detects alone, on late fusion's frame
            return [{"ego": model(model_input["ego"])}]
        output = model(model_input["ego"])
        # Per-sample maps are split by frame; a 0-d value describes the whole batch (Where2comm's comm_rate).
        return [{"ego": {key: value[i:i + 1] if value.dim() > 0 else value for key, value in output.items()}}
                for i in range(frames)]

    def __call__(self, model: nn.Module, batch: Mapping[str, Any], indices: Sequence[int]) -> List[FrameStats]:
        frames = batch["frames"]
        records = []
        for index, frame, output in zip(indices, frames, self.outputs(model, batch["model_input"], len(frames))):
            # No fusion: the ego's detections against the frame's whole ground truth (V2V4Real's inference_no_fusion).
            detected = {cav: frame[cav] for cav in output}
            boxes, scores = self.convention.predictions(*self.post.post_process(detected, output))
            gt = self.post.generate_gt_bbx(frame)
            if self.exporter is not None:
                self.exporter(index, frame_points(frame), _numpy(boxes), _numpy(scores), _numpy(gt),
                              frame_cav_positions(frame))
            stats = frame_stats(boxes, scores, gt)
            if self.meter is not None:  # what the frame's CAVs sent travels with its statistics
                stats = MeteredFrameStats.of(stats, self.meter.frame(output, frame))
            records.append(self.convention.with_bands(stats, boxes, scores, gt))
        return records


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def frame_points(frame: Mapping[str, Any]) -> np.ndarray:
    """All CAVs' points in the ego frame (the test batch's ``origin_lidar``, built when visualizing)."""
    lidar = frame["ego"]["origin_lidar"]
    return _numpy(lidar[0])


def frame_cav_positions(frame: Mapping[str, Any]) -> np.ndarray:
    """(K, 3) CAV LiDAR origins in the ego frame, ego first: early/intermediate carry them, late fusion's
    per-CAV transformation matrices hold them."""
    ego = frame["ego"]
    if "cav_positions" in ego:
        return _numpy(ego["cav_positions"][0])
    return np.stack([_numpy(cav["transformation_matrix"])[:3, 3] for cav in frame.values()])


class PrPlot:
    """Rank 0, after the gather: precision-recall curves at IoU 0.3/0.5/0.7 in one PNG."""

    def __init__(self, path: Path, convention: EvalConvention):
        self.path, self.convention = path, convention

    def __call__(self, frames: List[FrameStats]) -> None:
        from opencood_ddp.vis import plot_pr_curves

        curves = {f"IoU {threshold:g}": (curve.recall, curve.precision, curve.ap)
                  for threshold, curve in pr_curve(frames, self.convention.global_sort).items()}
        plot_pr_curves(self.path, curves, title=f"precision-recall, {len(frames)} frames "
                                                f"({self.convention.preset}, {self.convention.ap_convention})")


@dataclass(frozen=True)
class DetectionEvalOptions:
    """The task's evaluation options: tools/inference_ddp.py's flags of ``add_arguments`` (dest = field name)."""

    fusion_method: Optional[str] = None  # None: the one the run's hypes imply
    global_sort: bool = False
    save_vis: bool = False
    save_npy: bool = False
    pr_plot: bool = False
    eval_preset: str = DEFAULT_PRESET  # tasks/eval_presets.py: AP ranking, evaluation range, distance bands

    @classmethod
    def of(cls, request: EvalRequest) -> "DetectionEvalOptions":
        """The options the request carries, or the defaults (--eval_after_training)."""
        options = request.task_options
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise TypeError(f"EvalRequest.task_options must be a {cls.__name__}, got {type(options).__name__}")
        return options

    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        """The detection flags; --fusion_method's choices are the registered datasets'."""
        parser.add_argument("--fusion_method", required=True, choices=sorted(fusion_methods()),
                            help="the fusion the run was trained with (upstream's flag)")
        parser.add_argument("--eval_preset", choices=PRESETS, default=DEFAULT_PRESET,
                            help="the AP convention: opencood (upstream's frame order and GT range, the default), "
                                 "heal (global sort; x +-102.4, y +-51.2, detections tested on z too), v2v4real "
                                 "(frame order; x +-100, y +-40; AP per distance band 0-30, 30-50, 50-100 m); "
                                 "writes eval.yaml, eval_heal.yaml or eval_v2v4real.yaml")
        parser.add_argument("--global_sort_detections", dest="global_sort", action="store_true",
                            help="sort all detections by score before AP (default: upstream's frame order); "
                                 "heal sorts anyway, v2v4real refuses it")
        parser.add_argument("--save_vis", action="store_true", help="bird's-eye-view PNG per frame in MODEL_DIR/vis/")
        parser.add_argument("--save_npy", action="store_true",
                            help="per frame MODEL_DIR/npy/{index:04d}_pcd.npy, _pred.npy, _gt.npy (upstream's files)")
        parser.add_argument("--pr_plot", action="store_true",
                            help="precision-recall curves at IoU 0.3/0.5/0.7 in MODEL_DIR/pr_curve.png "
                                 "(pr_curve_global_sort.png, _heal.png, _v2v4real.png: eval.yaml's suffix)")


# The task's evaluation options, found here by the task registry (tasks.eval_options) beside build_eval: the
# flags tools/inference_ddp.py adds for a run of this task.
EVAL_OPTIONS = DetectionEvalOptions


def eval_dataset_hypes(hypes: dict, request: EvalRequest, fusion_method: str) -> dict:
    """The hypes of the split to evaluate, checked against the fusion method and --batch_size."""
    source = hypes_source(hypes)
    found = hypes.get("fusion", {}).get("core_method")
    datasets = fusion_methods()
    if fusion_method not in datasets:
        raise ConfigError(f"--fusion_method must be one of {', '.join(sorted(datasets))}, got {fusion_method!r}")
    wanted = datasets[fusion_method]
    if found != wanted:
        raise ConfigError(f"{source}: --fusion_method {fusion_method} needs fusion.core_method {wanted}, "
                          f"the model was trained with {found}; pass the matching --fusion_method")
    if request.batch_size < 1:
        raise ConfigError(f"--batch_size must be at least 1, got {request.batch_size}; pass 1 or more")
    if fusion_method in ("late", NO_FUSION) and request.batch_size != 1:
        named = "late fusion" if fusion_method == "late" else "no fusion"
        raise ConfigError(f"--batch_size {request.batch_size}: {named} evaluates one frame per batch (each CAV "
                          f"detects on its own); pass --batch_size 1, or use early or intermediate fusion")
    hypes = copy.deepcopy(hypes)
    # The split is checked here, under the name the user gave it, before it stands in for validate_dir.
    if request.dataset_dir is not None:
        hypes["validate_dir"] = check_split_path(hypes, request.dataset_dir, "--dataset_dir")
    elif request.test_split and hypes.get("test_dir"):
        hypes["validate_dir"] = check_split_path(hypes, hypes["test_dir"], "test_dir")
    elif not request.test_split:  # the run's own validate_dir, often another machine's path: the tool's flag fixes it
        hypes["validate_dir"] = check_split_path(hypes, hypes["validate_dir"], "validate_dir",
                                                 "pass --dataset_dir (or edit validate_dir in the run's config.yaml "
                                                 "to name)")
    return hypes


def fusion_method_of(hypes: Mapping) -> str:
    """--fusion_method implied by the hypes' dataset (training's --eval_after_training)."""
    found = hypes.get("fusion", {}).get("core_method")
    datasets = fusion_methods()
    methods = [method for method, dataset in datasets.items() if dataset == found]
    if not methods:
        raise ConfigError(f"{hypes_source(hypes)}: fusion.core_method {found!r} is not one of "
                          f"{', '.join(sorted(datasets.values()))}; it cannot be evaluated: fix the hypes")
    return methods[0]


def build_exporter(hypes: dict, options: DetectionEvalOptions, run_dir: Optional[str], evaluated: Mapping,
                   result_name: str) -> Optional[FrameExporter]:
    """The --save_npy / --save_vis writer; ``evaluated`` is eval.yaml's (`evaluated_split`), which its folders'
    manifest repeats with the split's scenarios."""
    if not (options.save_npy or options.save_vis):
        return None
    if run_dir is None:
        raise ConfigError("--save_npy / --save_vis need an output folder (the run's --model_dir)")
    from opencood_ddp.vis.export import FrameExporter, split_scenarios

    split = evaluated["dataset_dir"]
    about = {"split": split, "scenarios": split_scenarios(Path(split)), "fusion_method": evaluated["fusion_method"],
             "eval_preset": options.eval_preset}
    return FrameExporter(Path(run_dir), options.save_npy, options.save_vis,
                         evaluation_gt_range(hypes, hypes_source(hypes)), about, tag=Path(result_name).stem)


def eval_file_name(global_sort: bool, preset: str = DEFAULT_PRESET, fusion_method: str = "") -> str:
    """eval.yaml, eval_global_sort.yaml (opencood with --global_sort_detections), eval_heal.yaml, eval_v2v4real.yaml;
    no fusion evaluates the late-fusion run itself, so its files say so (eval_nofusion.yaml, ...)."""
    return f"eval{fusion_suffix(fusion_method)}{result_suffix(preset, global_sort)}.yaml"


def pr_plot_name(global_sort: bool, preset: str = DEFAULT_PRESET, fusion_method: str = "") -> str:
    return f"pr_curve{fusion_suffix(fusion_method)}{result_suffix(preset, global_sort)}.png"


def fusion_suffix(fusion_method: str) -> str:
    return f"_{NO_FUSION}" if fusion_method == NO_FUSION else ""


class Report:
    """Rank 0's text after evaluation: the convention, the AP table (and the band APs) and the files written."""

    def __init__(self, options: DetectionEvalOptions, run_dir: Optional[str],
                 convention: EvalConvention = EvalConvention()):
        self.options, self.run_dir = options, Path(run_dir) if run_dir is not None else None
        self.convention = convention

    def __call__(self, result: EvalResult) -> str:
        s = result.summary
        rows = ["| IoU | AP |", "|---|---:|"] + [f"| {iou} | {s[key]:.4f} |" for iou, key in
                                                (("0.3", "ap30"), ("0.5", "ap_50"), ("0.7", "ap_70"))]
        return "\n".join([self.convention.describe()] + rows + band_rows(s) + communication_lines(s)
                         + self.written_files())

    def written_files(self) -> List[str]:
        if self.run_dir is None:
            return []
        lines = []
        if self.options.save_vis:
            lines.append(f"bird's-eye-view pictures: {self.run_dir / 'vis'}/bev_*.png")
        if self.options.save_npy:
            lines.append(f"arrays: {self.run_dir / 'npy'}/*_pcd.npy, *_pred.npy, *_gt.npy")
        if self.options.pr_plot:
            name = pr_plot_name(self.options.global_sort, self.convention.preset, self.options.fusion_method or "")
            lines.append(f"precision-recall curves: {self.run_dir / name}")
        return lines


def readable_bytes(count: float) -> str:
    """8650752 -> '8.25 MiB'; late fusion's few boxes stay in bytes."""
    for unit, size in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def communication_lines(summary: dict) -> List[str]:
    """What a cooperating CAV sent per frame (tasks/communication.py), beside the AP it bought; nothing where the
    evaluated fusion is not metered (early fusion)."""
    if summary.get("bytes_per_cav_frame") is None:
        return []
    line = f"sent per cooperating CAV and frame: {readable_bytes(summary['bytes_per_cav_frame'])}"
    if summary.get("comm_rate") is not None:
        line += (f" (Where2comm: comm_rate {summary['comm_rate']:.4f} of the non-ego cells; OpenCOOD's com "
                 f"{summary['com']:.4f})")
    return [line]


@dataclass
class DetectionEvaluator:
    """The task's ``Evaluator`` (engine/evaluator.py): on every rank each frame's detections against its GT
    (``FrameEvaluator``); on rank 0 the metric of the run's convention (``metrics/summary.DetectionMetric``), the
    --pr_plot curves and the report."""

    evaluate_batch: FrameEvaluator
    metric: Callable[[List[FrameStats]], dict]  # a DetectionMetric (tasks/sweep.py adds a score digest to it)
    result_name: str
    report: Report
    pr_plot: Optional[PrPlot] = None

    def finish(self, frames: List[FrameStats]) -> None:
        if self.evaluate_batch.exporter is not None:  # every frame written, the metric computed: the run's now
            self.evaluate_batch.exporter.publish(len(frames))
        if self.pr_plot is not None:
            self.pr_plot(frames)


def build_pr_plot(options: DetectionEvalOptions, run_dir: Optional[str], convention: EvalConvention,
                  fusion_method: str) -> Optional[PrPlot]:
    if not options.pr_plot or run_dir is None:
        return None
    return PrPlot(Path(run_dir) / pr_plot_name(options.global_sort, convention.preset, fusion_method), convention)


_SAID_UNKNOWN: set = set()


def warn_unknown_keys(hypes: Mapping) -> None:
    """An evaluation reads the run's own config.yaml, which training checked; keys nobody reads there come from a
    hand edit, a fork's run or an older version. They are said, not refused: the run stays evaluable."""
    named = named_unknown_keys(hypes, TASK_KEYS)
    said = (hypes_source(hypes), tuple(named))
    if named and said not in _SAID_UNKNOWN:  # once a process: a noise sweep builds an evaluation per level
        _SAID_UNKNOWN.add(said)
        get_logger().warning(f"{hypes_source(hypes)}: nothing reads the key{'s' if len(named) > 1 else ''} "
                             f"{', '.join(named)}; the evaluation uses the defaults in their place (fix the run's "
                             f"config.yaml if a key is misspelt)")


def evaluated_split(hypes: Mapping, fusion_method: str) -> dict:
    """eval.yaml's first keys: the split the numbers are of (resolved: `--dataset_dir` or the run's validate_dir)
    and the fusion method, named as the noise sweep's table names them."""
    return {"dataset_dir": str(Path(hypes["validate_dir"]).resolve()), "fusion_method": fusion_method}


def build_eval(hypes: dict, request: EvalRequest) -> EvalSpec:
    import_modules(hypes, hypes_source(hypes))
    warn_unknown_keys(hypes)
    check_delay_table(hypes)
    options = DetectionEvalOptions.of(request)
    fusion_method = options.fusion_method or fusion_method_of(hypes)
    hypes = eval_dataset_hypes(hypes, request, fusion_method)
    convention = eval_convention(options.eval_preset, options.global_sort, hypes, hypes_source(hypes))
    hypes = convention.eval_hypes(hypes)  # the preset's area reaches the dataset's GT and the post-processor
    seed = int(hypes.get("train_params", {}).get("seed", 0))
    post = create_postprocessor(hypes, train=False)
    result_name = eval_file_name(options.global_sort, convention.preset, fusion_method)
    evaluated = evaluated_split(hypes, fusion_method)
    exporter = build_exporter(hypes, options, request.run_dir, evaluated, result_name)
    dataset = build_dataset(hypes, "validate", train=False, seed=seed, post_processor=post,
                            visualize=exporter is not None)
    meter = CommunicationMeter.of(hypes, fusion_method)
    evaluator = DetectionEvaluator(
        evaluate_batch=FrameEvaluator(post, fusion_method, exporter, meter, convention),
        metric=convention.metric(meter.summary if meter is not None else None, evaluated),
        result_name=result_name,
        report=Report(options, request.run_dir, convention),
        pr_plot=build_pr_plot(options, request.run_dir, convention, fusion_method))
    return EvalSpec(dataset=dataset, collate=EvalCollate(dataset), model=create_model(hypes), move_to=prepare_batch,
                    evaluator=evaluator, gpu_workers=gpu_workers(dataset))


__all__ = ["build_task", "build_eval", "EVAL_OPTIONS", "DetectionEvalOptions", "DetectionEvaluator",
           "DetectionStep", "batch_size_of", "eval_file_name", "fusion_suffix", "pr_plot_name"]
