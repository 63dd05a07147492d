"""Pose-noise and delay sweeps of one checkpoint: the recipe behind tools/noise_sweep.py (docs/robustness.md).

Each level of the sweep is a copy of the run's hypes whose ``wild_setting`` says the level's localisation error
and communication delay; the same checkpoint is evaluated at every level with the engine's
``evaluate_checkpoint`` on every rank, so every level's AP is the 1-process AP on any world size. Rank 0 then
writes one table beside the run's eval.yaml, which the sweep never touches: the per-level result files go to a
scratch folder.

The noise is upstream's ``wild_setting.loc_err`` (data/wild.py) in three modes: ``xyz_std`` = the level's
position spread on x, y and z, ``ryp_std`` = its rotation spread on the yaw, every non-ego CAV perturbed, the
ego and the ground truth left alone. ``loc_err_mode`` is ``--noise_mode``: ``per_sample`` draws each CAV's
error of each frame independently (from generators keyed by the sample, so the same on every world size);
``upstream`` replays upstream's reseed, one fixed offset for every non-ego pose (which upstream's early and late
datasets never apply); ``v2xvit`` is that offset applied by every dataset, as the V2X-ViT repository's. The
fourth mode, ``heal``, sets HEAL's and CoAlign's ``noise_setting`` instead, as their inference_w_noise.py does:
``pos_std`` on x and y, ``rot_std`` on the yaw, zero means, every CAV perturbed, the ego included, drawn per CAV
and frame. Otherwise a run's own ``noise_setting`` is switched off at every level, and a level without noise is
the clean input, bit for bit. A delay is ``wild_setting.async`` in ``sim`` mode with ``async_overhead`` = the
delay: whole 100 ms frames (floor), the ego never delayed.
"""
from __future__ import annotations

import copy
import hashlib
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence

import numpy as np
import yaml

from opencood_ddp.atomic import atomic_write
from opencood_ddp.data.wild import REPLAYED_MODES, DelaySetting, delay_frames
from opencood_ddp.engine import inference
from opencood_ddp.engine.entry import run_distributed
from opencood_ddp.engine.evaluator import EvalRequest, EvalResult, EvalSpec
from opencood_ddp.engine.loaders import workers_per_rank
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.options import EvalOptions, ProcessOptions, eval_parser, from_flags
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import RANDOM_STATE_SEEDS, get_key, hypes_source, naming_file
from opencood_ddp.metrics.conventions import AP_CONVENTIONS
from opencood_ddp.schema import check_selected_entries
from opencood_ddp.tasks import build_eval as build_task_eval
from opencood_ddp.tasks.eval_presets import DEFAULT_PRESET, preset_global_sort, result_suffix
from opencood_ddp.tasks.opencood import NO_FUSION, DetectionEvalOptions, check_delay_table, fusion_suffix
from opencood_ddp.vis.sweep_plot import SweepPanel, plot_sweep

DEFAULT_STDS = (0.0, 0.2, 0.4, 0.6)  # HEAL's and CoAlign's inference_w_noise.py levels (m and degrees)
HEAL_MODE = "heal"  # HEAL's and CoAlign's noise_setting, not wild_setting.loc_err
NOISE_MODES = ("per_sample", "upstream", "v2xvit", HEAL_MODE)  # the first three: data/wild.py LOC_ERR_MODES
DEFAULT_NOISE_MODE = "per_sample"
DEFAULT_NOISE_SEED = 25  # V2X-ViT's wild_setting.seed, for runs whose config has none
CLEAN = "none"  # a level's mode when its poses are the true ones
# The flags of inference_ddp.py that write per-frame files or one picture per evaluation: a sweep would
# overwrite them level after level, so it refuses them.
PER_EVALUATION_FILES = (("save_vis", "--save_vis"), ("save_npy", "--save_npy"), ("pr_plot", "--pr_plot"))
AP_COLUMNS = (("ap30", "AP@0.3"), ("ap_50", "AP@0.5"), ("ap_70", "AP@0.7"))
DETECTIONS, SCORE_DIGEST = "detections", "score_digest"


# ----------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class SweepOptions:
    """tools/noise_sweep.py's flags: inference_ddp.py's (``eval``, with DetectionEvalOptions) and the levels'."""

    eval: EvalOptions
    pos_std: tuple = DEFAULT_STDS  # metres
    rot_std: Optional[tuple] = None  # degrees; None: pos_std's values
    delays_ms: tuple = ()
    noise_mode: str = DEFAULT_NOISE_MODE
    noise_seed: Optional[int] = None  # None: the run's wild_setting.seed, else DEFAULT_NOISE_SEED

    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        parser.add_argument("--pos_std", type=float, nargs="+", default=DEFAULT_STDS, metavar="M",
                            help="position noise std per level, metres, on x, y and z of every non-ego CAV "
                                 "(--noise_mode heal: x and y of every CAV) (default: 0 0.2 0.4 0.6)")
        parser.add_argument("--rot_std", type=float, nargs="+", metavar="DEG",
                            help="yaw noise std per level, degrees, paired with --pos_std level by level "
                                 "(default: --pos_std's values)")
        parser.add_argument("--delays_ms", type=float, nargs="+", default=(), metavar="MS",
                            help="also evaluate each communication delay at zero noise (wild_setting async, sim "
                                 "mode: whole 100 ms frames, floor), e.g. 0 100 200 300")
        parser.add_argument("--noise_mode", choices=NOISE_MODES, default=DEFAULT_NOISE_MODE,
                            help="per_sample: an independent error per CAV and frame (default); upstream: "
                                 "upstream's reseed quirk, one offset for every CAV and frame, applied by the "
                                 "intermediate dataset only; v2xvit: that offset in every dataset, as the V2X-ViT "
                                 "repository's; heal: HEAL's and CoAlign's noise_setting (x, y and yaw of every "
                                 "CAV, the ego included, per CAV and frame), as their inference_w_noise.py")
        parser.add_argument("--noise_seed", type=int,
                            help=f"wild_setting.seed of every level (default: the run's, else "
                                 f"{DEFAULT_NOISE_SEED})")


def sweep_parser():
    parser = eval_parser(DetectionEvalOptions)
    parser.description = ("Evaluate one checkpoint under pose noise and communication delay on 1..N processes; "
                          "one AP table in the run folder (--save_vis, --save_npy, --pr_plot are refused).")
    SweepOptions.add_arguments(parser.add_argument_group("sweep"))
    return parser


def parse_sweep_options(argv: Optional[Sequence[str]]) -> SweepOptions:
    parsed = sweep_parser().parse_args(argv)
    evaluation = from_flags(EvalOptions, parsed, process=from_flags(ProcessOptions, parsed),
                            task=from_flags(DetectionEvalOptions, parsed))
    return from_flags(SweepOptions, parsed, eval=evaluation)


# ------------------------------------------------------------------------------------------------ levels
@dataclass(frozen=True)
class Level:
    pos_std: float
    rot_std: float
    delay_ms: float
    noise_mode: str

    @property
    def noisy(self) -> bool:
        return self.pos_std > 0 or self.rot_std > 0

    @property
    def mode(self) -> str:
        return self.noise_mode if self.noisy else CLEAN

    @property
    def delay_frames(self) -> int:
        return delay_frames(DelaySetting(enabled=True, mode="sim", overhead_ms=self.delay_ms), ego=False)

    def describe(self) -> str:
        return (f"pos_std {self.pos_std:g} m, rot_std {self.rot_std:g} deg, delay {self.delay_ms:g} ms "
                f"({self.delay_frames} frame(s)), noise {self.mode}")


def _non_negative(values: Sequence[float], flag: str, unit: str, example: str) -> None:
    for value in values:
        if not value >= 0 or math.isinf(value):  # NaN fails the comparison
            raise ConfigError(f"{flag} {value:g}: every value must be a finite number >= 0 ({unit}); pass values "
                              f"such as {flag} {example}")


def sweep_levels(options: SweepOptions) -> List[Level]:
    """The noise levels at zero delay, in the order given, then each delay at zero noise; a level asked for twice
    (zero noise and zero delay, say) is evaluated once. A bad flag is one ConfigError."""
    rot_std = options.pos_std if options.rot_std is None else options.rot_std
    _non_negative(options.pos_std, "--pos_std", "metres", "0 0.2 0.4 0.6")
    _non_negative(rot_std, "--rot_std", "degrees", "0 0.2 0.4 0.6")
    _non_negative(options.delays_ms, "--delays_ms", "milliseconds", "0 100 200 300")
    if len(rot_std) != len(options.pos_std):
        raise ConfigError(f"--rot_std has {len(rot_std)} value(s) and --pos_std {len(options.pos_std)}; they pair "
                          f"level by level: give both the same number of values, or leave --rot_std out to use "
                          f"--pos_std's")
    if options.noise_mode not in NOISE_MODES:
        raise ConfigError(f"--noise_mode must be one of {', '.join(NOISE_MODES)}, got {options.noise_mode!r}")
    levels = [Level(float(pos), float(rot), 0.0, options.noise_mode) for pos, rot in zip(options.pos_std, rot_std)]
    levels += [Level(0.0, 0.0, float(delay), options.noise_mode) for delay in options.delays_ms]
    return list(dict.fromkeys(levels))  # first occurrence kept, order kept


def level_flags(level: Level) -> str:
    """The flags that asked for ``level``."""
    if level.delay_ms > 0:
        return f"--delays_ms {level.delay_ms:g}"
    return f"--pos_std {level.pos_std:g} --rot_std {level.rot_std:g}"


def check_levels(hypes: dict, levels: Sequence[Level], seed: int) -> None:
    """Every level's hypes through the checks its build runs, before the first level is evaluated: a level the run
    cannot take (a delay on DAIR-V2X-C's single frame pairs) is refused up front, naming the flag that asked for
    it, not after the levels before it were evaluated and lost."""
    check_selected_entries(hypes, hypes_source(hypes))  # the run's own faults are not a level's
    for level in levels:
        try:
            level_run = level_hypes(hypes, level, seed)
            check_selected_entries(level_run, hypes_source(hypes))
            check_delay_table(level_run)
        except ConfigError as error:
            raise ConfigError(f"{level_flags(level)}: the run cannot be evaluated at this level ({error}); leave "
                              f"the level out of the sweep") from None


def refuse_per_evaluation_files(task: DetectionEvalOptions) -> None:
    for field, flag in PER_EVALUATION_FILES:
        if getattr(task, field):
            raise ConfigError(f"{flag}: tools/noise_sweep.py writes one table for all levels, not one evaluation's "
                              f"files; drop {flag}, or evaluate one setting with tools/inference_ddp.py")


def noise_seed(options: SweepOptions, hypes: Mapping) -> int:
    """--noise_seed, else the run's own wild_setting.seed, else V2X-ViT's."""
    if options.noise_seed is not None:
        if not 0 <= options.noise_seed < RANDOM_STATE_SEEDS:
            raise ConfigError(f"--noise_seed {options.noise_seed}: must be in [0, 2**32) (numpy's RandomState); "
                              f"pass another seed")
        return options.noise_seed
    return int(get_key(hypes, "wild_setting.seed", DEFAULT_NOISE_SEED))


def level_hypes(hypes: dict, level: Level, seed: int) -> dict:
    """The run's hypes with the level's delay and localisation error, and nothing else of the run's own."""
    hypes = copy.deepcopy(hypes)
    wild = dict(hypes.get("wild_setting") or {})
    wild.update({"seed": seed, "async": level.delay_ms > 0, "async_mode": "sim", "async_overhead": level.delay_ms})
    if level.noise_mode == HEAL_MODE:
        # As HEAL's and CoAlign's inference_w_noise.py set it: the args replaced whole, zero means.
        wild["loc_err"] = False
        hypes["noise_setting"] = {"add_noise": level.noisy, "args": {
            "pos_std": level.pos_std, "rot_std": level.rot_std, "pos_mean": 0.0, "rot_mean": 0.0}}
    else:
        wild.update({"loc_err": level.noisy, "loc_err_mode": level.noise_mode, "xyz_std": level.pos_std,
                     "ryp_std": level.rot_std})
        if isinstance(hypes.get("noise_setting"), dict):  # one localisation error at a time: the level's
            hypes["noise_setting"] = dict(hypes["noise_setting"], add_noise=False)
    hypes["wild_setting"] = wild
    return hypes


# ------------------------------------------------------------------------------------------------ recipe
class WithScoreDigest:
    """The task's metric plus what shows that a level's inputs changed even where its AP did not: the number
    of detections and a digest of every frame's scores in dataset order (equal digests: the same detections)."""

    def __init__(self, metric: Callable[[List[Any]], dict]):
        self.metric = metric

    def __call__(self, frames: List[Any]) -> dict:
        digest, count = hashlib.sha256(), 0
        for frame in frames:
            scores = np.asarray(next(iter(frame.by_threshold.values())).scores, dtype=np.float64)
            digest.update(len(scores).to_bytes(8, "little"))
            digest.update(scores.tobytes())
            count += len(scores)
        return dict(self.metric(frames), **{DETECTIONS: count, SCORE_DIGEST: digest.hexdigest()[:16]})


def ignores_the_noise(spec: EvalSpec, level: Level) -> bool:
    """Whether the level's noise cannot reach this dataset: upstream mode, which upstream's early and late
    datasets never apply (they project with the true poses)."""
    return level.noisy and level.noise_mode == "upstream" and not getattr(spec.dataset, "reads_upstream_loc_err",
                                                                        True)


def warn_ego_alone(levels: Sequence[Level]) -> None:
    """nofusion: the ego detects on its own cloud in its own frame, which no pose error moves (an error of the
    ego's pose, --noise_mode heal, moves the others' clouds onto it), and the sweep never delays the ego."""
    if any(level.noisy or level.delay_ms > 0 for level in levels):
        get_logger().warning("--fusion_method nofusion: the ego detects alone on its own cloud in its own frame, "
                             "which no pose error moves, and the sweep never delays it, so every level equals the "
                             "clean one")


def warn_noise_ignored(spec: EvalSpec) -> None:
    get_logger().warning(f"--noise_mode upstream: {type(spec.dataset).__name__} projects with the true poses (as "
                         f"upstream's early and late datasets do), so every noise level equals the clean one; use "
                         f"--noise_mode per_sample to perturb it")


@dataclass
class SweepRun:
    """What was evaluated: the levels and rank 0's results (None on the other ranks)."""

    levels: List[Level]
    results: List[Optional[EvalResult]]
    checkpoint: Path
    split: Optional[str]  # the evaluated split, resolved as eval.yaml names it: --dataset_dir, else validate_dir
    seed: int


def evaluate_levels(options: SweepOptions, env: Any, build_eval: inference.EvalBuilder) -> SweepRun:
    """Every level evaluated on every rank."""
    levels = sweep_levels(options)  # on every rank: each raises the same refusal and leaves together
    refuse_per_evaluation_files(options.eval.task)
    run = inference.run_to_evaluate(options.eval)
    hypes, checkpoint = run.hypes, run.checkpoint
    seed = noise_seed(options, hypes)
    with naming_file(hypes, run.config):
        check_levels(hypes, levels, seed)
    if options.eval.task.fusion_method == NO_FUSION:
        warn_ego_alone(levels)
    log, warned, results = get_logger(), False, []
    # The engine writes each level's eval.yaml into the request's folder: a scratch one, so that the run's own
    # eval.yaml stays what it was.
    with tempfile.TemporaryDirectory(prefix="noise_sweep_") as scratch:
        for number, level in enumerate(levels, 1):
            log.info(f"noise sweep level {number}/{len(levels)}: {level.describe()}")
            request = EvalRequest(dataset_dir=options.eval.dataset_dir, batch_size=options.eval.batch_size,
                                  run_dir=scratch, task_options=options.eval.task)
            with naming_file(hypes, run.config):
                spec = build_eval(level_hypes(hypes, level, seed), request)
            spec.evaluator.metric = WithScoreDigest(spec.evaluator.metric)  # this level's own evaluator
            if not warned and ignores_the_noise(spec, level):
                warn_noise_ignored(spec)
                warned = True
            workers = workers_per_rank(options.eval.process.num_workers, env, task_workers=spec.gpu_workers)
            results.append(inference.evaluate_checkpoint(spec, request, checkpoint, env, workers))
    # The split as each level's eval.yaml names it (resolved), where the task's metric writes it.
    named = [result.summary["dataset_dir"] for result in results
             if result is not None and "dataset_dir" in result.summary]
    split = named[0] if named else options.eval.dataset_dir or hypes.get("validate_dir")
    return SweepRun(levels, results, checkpoint, split, seed)


def run_sweep(options: SweepOptions, env: Any, build_eval: inference.EvalBuilder = build_task_eval) \
        -> Optional[dict]:
    """The sweep on every rank; rank 0 writes noise_sweep.{yaml,md,png} into the run and returns the table."""
    run = evaluate_levels(options, env, build_eval)
    if not env.is_main:
        return None
    table = sweep_table(options, run)
    paths = write_sweep(Path(options.eval.model_dir), table)
    get_logger().info(markdown_table(table) + "\nwrote " + ", ".join(str(path) for path in paths))
    return table


def main(argv: Optional[Sequence[str]]) -> int:
    options = parse_sweep_options(argv)
    return run_distributed(options.eval.process, lambda env: run_sweep(options, env))


# ------------------------------------------------------------------------------------------------- table
def ap_convention(global_sort: bool) -> str:
    return AP_CONVENTIONS[global_sort]  # the words eval.yaml uses


def noise_axes(mode: str) -> str:
    """What a level's spreads perturb, for the table's header."""
    if mode == HEAL_MODE:
        return ("pos_std on x, y (m) and rot_std on yaw (degrees) of every CAV, the ego included, drawn per CAV and "
                "frame (HEAL's and CoAlign's noise_setting)")
    draw = "one offset for every CAV and frame (upstream's reseed)" if mode in REPLAYED_MODES \
        else "drawn per CAV and frame"
    return f"pos_std on x, y, z (m) and rot_std on yaw (degrees) of every non-ego CAV, {draw}"


def level_entry(level: Level, result: EvalResult, convention: str) -> dict:
    summary = result.summary
    entry = {"pos_std": level.pos_std, "rot_std": level.rot_std, "delay_ms": level.delay_ms,
             "delay_frames": level.delay_frames, "mode": level.mode}
    entry.update({key: summary[key] for key, _ in AP_COLUMNS})
    entry.update(frames=result.frames, detections=summary[DETECTIONS], score_digest=summary[SCORE_DIGEST],
                 ap_convention=convention)
    return entry


def sweep_table(options: SweepOptions, run: SweepRun) -> dict:
    """noise_sweep.yaml's content (rank 0): what was evaluated, then one entry per level."""
    task: DetectionEvalOptions = options.eval.task
    convention = ap_convention(preset_global_sort(task.eval_preset, task.global_sort))
    results = run.results
    return {
        "checkpoint": run.checkpoint.name,
        "dataset_dir": run.split,
        "fusion_method": task.fusion_method,
        "noise_mode": options.noise_mode,
        "noise_seed": run.seed,
        "noise": noise_axes(options.noise_mode),
        "delay": "wild_setting async, sim mode: whole 100 ms frames (floor); the ego is never delayed",
        **convention_record(task.eval_preset, convention, results),
        "world_size": results[0].world_size if results else 1,
        "seconds": round(sum(result.seconds for result in results), 3),
        "levels": [level_entry(level, result, convention) for level, result in zip(run.levels, results)],
    }


def convention_record(preset: str, convention: str, results: Sequence[EvalResult]) -> dict:
    """The table's AP convention: the preset, its ranking and the area its levels were evaluated in (the
    levels' own eval.yaml files are scratch)."""
    record = {"eval_preset": preset, "ap_convention": convention}
    if results and "eval_range" in results[0].summary:
        record["eval_range"] = results[0].summary["eval_range"]
    return record


def sweep_file_stem(global_sort: bool, preset: str = DEFAULT_PRESET, fusion_method: str = "",
                    noise_mode: str = DEFAULT_NOISE_MODE) -> str:
    """As eval.yaml, eval_global_sort.yaml, eval_heal.yaml, eval_nofusion.yaml: no convention, and no fusion of the
    same run, overwrites another's table; nor does another noise mode (noise_sweep_heal_noise.yaml: HEAL's
    noise_setting, beside the preset's noise_sweep_heal.yaml)."""
    mode = "" if noise_mode == DEFAULT_NOISE_MODE else f"_{noise_mode}_noise"
    return f"noise_sweep{mode}{fusion_suffix(fusion_method)}{result_suffix(preset, global_sort)}"


def _number(value: float) -> str:
    return f"{value:g}"


def _ap(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}"


def markdown_table(table: Mapping) -> str:
    axes = "x, y" if table["noise_mode"] == HEAL_MODE else "x, y, z"
    header = f"| pos std (m; {axes}) | rot std (deg; yaw) | delay (ms) | noise | AP@0.3 | AP@0.5 | AP@0.7 | frames |"
    rows = [f"| {_number(e['pos_std'])} | {_number(e['rot_std'])} | {_number(e['delay_ms'])} | {e['mode']} | "
            + " | ".join(_ap(e[key]) for key, _ in AP_COLUMNS) + f" | {e['frames']} |" for e in table["levels"]]
    caption = (f"Noise and delay sweep of {table['checkpoint']} ({table['fusion_method']} fusion), AP in "
               f"{table['ap_convention']} ({table.get('eval_preset', DEFAULT_PRESET)} preset); "
               f"noise {table['noise_mode']} (seed {table['noise_seed']}): "
               f"{table['noise']}.")
    return "\n".join([caption, "", header, "|---:|---:|---:|---|---:|---:|---:|---:|", *rows])


def sweep_panels(levels: Sequence[Mapping]) -> List[SweepPanel]:
    """AP against the noise levels (at zero delay, in order, the clean level first: it can come from --delays_ms 0)
    and, with delays, against the delay (clean poses)."""
    panels = []
    noise = sorted((e for e in levels if e["delay_ms"] == 0), key=lambda e: e["mode"] != CLEAN)  # stable
    if noise:
        panels.append(_panel("noise std: position (m) / yaw (deg)", noise,
                             [f"{_number(e['pos_std'])}/{_number(e['rot_std'])}" for e in noise]))
    delayed = sorted((e for e in levels if e["mode"] == CLEAN), key=lambda e: e["delay_ms"])
    if any(e["delay_ms"] > 0 for e in delayed):
        panels.append(_panel("communication delay (ms)", delayed, [_number(e["delay_ms"]) for e in delayed]))
    return panels


def _panel(xlabel: str, levels: Sequence[Mapping], ticks: List[str]) -> SweepPanel:
    return SweepPanel(xlabel=xlabel, ticks=ticks,
                      series={label: [e[key] for e in levels] for key, label in AP_COLUMNS})


def write_sweep(run_dir: Path, table: Mapping) -> List[Path]:
    """noise_sweep.yaml, .md and .png (…_global_sort.* for that convention), each written atomically."""
    stem = run_dir / sweep_file_stem(table["ap_convention"] == ap_convention(True),
                                     table.get("eval_preset", DEFAULT_PRESET), table.get("fusion_method", ""),
                                     table.get("noise_mode", DEFAULT_NOISE_MODE))
    paths = [stem.with_suffix(".yaml"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    yaml_text = yaml.safe_dump(dict(table), sort_keys=False, width=120)
    atomic_write(paths[0], lambda handle: handle.write(yaml_text.encode()))
    markdown = markdown_table(table) + "\n"
    atomic_write(paths[1], lambda handle: handle.write(markdown.encode()))
    plot_sweep(paths[2], sweep_panels(table["levels"]), ylabel="AP",
               title=f"{table['checkpoint']}, {table['ap_convention']}, noise {table['noise_mode']}")
    return paths


__all__ = ["SweepOptions", "Level", "sweep_parser", "parse_sweep_options", "sweep_levels", "level_hypes",
           "noise_seed", "SweepRun", "evaluate_levels", "run_sweep", "main", "sweep_table", "markdown_table",
           "write_sweep", "sweep_file_stem"]
