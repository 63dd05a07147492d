"""tools/noise_sweep.py (tasks/sweep.py): one checkpoint evaluated under pose noise and communication delay.

In process: the levels built from the flags, the refusals of bad values (one `error:` line, non-zero exit), the
hypes of a level as the datasets read them, and the table, markdown and plot written by rank 0. Slow: a
one-epoch AttFuse run swept on 1 process and on 2 torchrun ranks gives the same table bit for bit, its clean level
is inference_ddp.py's AP, noise and delay change the detections, and the run's eval.yaml stays as it was.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from launch import REPO, explain, in_process, one_line_error, split_set_flags, torchrun, train
from opencood_ddp.data.wild import wild_setting_from_hypes
from opencood_ddp.engine.evaluator import EvalResult
from opencood_ddp.engine.options import EvalOptions
from opencood_ddp.errors import ConfigError
from opencood_ddp.metrics import DetectionStats, FrameStats
from opencood_ddp.tasks import sweep
from opencood_ddp.tasks.opencood import DetectionEvalOptions

SWEEP = REPO / "tools" / "noise_sweep.py"
INFERENCE = REPO / "tools" / "inference_ddp.py"


def options(**given) -> sweep.SweepOptions:
    task = DetectionEvalOptions(fusion_method="intermediate", global_sort=given.pop("global_sort", False))
    return sweep.SweepOptions(eval=EvalOptions(model_dir="RUN", task=task), **given)


def levels_of(**given) -> list[tuple]:
    return [(level.pos_std, level.rot_std, level.delay_ms, level.delay_frames, level.mode)
            for level in sweep.sweep_levels(options(**given))]


# ------------------------------------------------------------------------------------------ levels and flags
def test_levels_pair_pos_and_rot_then_add_each_delay_at_zero_noise():
    assert levels_of() == [(0, 0, 0, 0, "none"), (0.2, 0.2, 0, 0, "per_sample"), (0.4, 0.4, 0, 0, "per_sample"),
                           (0.6, 0.6, 0, 0, "per_sample")]
    # The clean level is asked twice (noise 0 and delay 0) and evaluated once; 250 ms is 2 whole frames.
    assert levels_of(pos_std=(0.0, 0.5), rot_std=(0.0, 1.0), delays_ms=(0.0, 100.0, 250.0),
                     noise_mode="upstream") == [(0, 0, 0, 0, "none"), (0.5, 1.0, 0, 0, "upstream"),
                                                (0, 0, 100, 1, "none"), (0, 0, 250, 2, "none")]


@pytest.mark.parametrize("given, fragments", [
    (dict(pos_std=(0.0, -0.2)), ("--pos_std -0.2", ">= 0", "metres")),
    (dict(rot_std=(0.0, 0.2, math.nan, 0.4)), ("--rot_std nan", ">= 0", "degrees")),
    (dict(rot_std=(0.0, 0.2)), ("--rot_std has 2 value(s) and --pos_std 4", "same number", "leave --rot_std out")),
    (dict(delays_ms=(100.0, -100.0)), ("--delays_ms -100", ">= 0", "milliseconds")),
])
def test_bad_levels_are_one_line_naming_the_flag_and_the_fix(given, fragments):
    with pytest.raises(ConfigError) as exc_info:
        sweep.sweep_levels(options(**given))
    one_line_error(exc_info, *fragments)


def test_a_bad_value_exits_non_zero_with_one_error_line():
    """Refused inside the recipe (every rank raises it), before any run is read: no run folder needed."""
    result = in_process(SWEEP, "--model_dir", "no_such_run", "--fusion_method", "intermediate",
                        "--pos_std", "0", "-0.2", "--num_workers", "0")
    assert result.returncode == ConfigError.exit_code, explain(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --pos_std -0.2"), result.stderr


def test_flags_parse_into_frozen_options_with_the_detection_flags():
    parsed = sweep.parse_sweep_options(["--model_dir", "RUN", "--fusion_method", "late", "--pos_std", "0", "0.3",
                                        "--delays_ms", "100", "--noise_mode", "upstream", "--noise_seed", "7",
                                        "--global_sort_detections", "--batch_size", "1"])
    assert parsed.eval.task == DetectionEvalOptions(fusion_method="late", global_sort=True)
    assert (parsed.pos_std, parsed.rot_std, parsed.delays_ms) == ((0.0, 0.3), None, (100.0,))
    assert (parsed.noise_mode, parsed.noise_seed, parsed.eval.model_dir) == ("upstream", 7, "RUN")
    defaults = sweep.parse_sweep_options(["--model_dir", "RUN", "--fusion_method", "late"])
    assert (defaults.pos_std, defaults.delays_ms, defaults.noise_mode) == ((0, 0.2, 0.4, 0.6), (), "per_sample")


@pytest.mark.parametrize("flag", ["save_vis", "save_npy", "pr_plot"])
def test_per_evaluation_files_are_refused(flag):
    with pytest.raises(ConfigError) as exc_info:
        sweep.refuse_per_evaluation_files(DetectionEvalOptions(fusion_method="late", **{flag: True}))
    one_line_error(exc_info, f"--{flag}", "tools/inference_ddp.py")


def test_noise_seed_is_the_flag_else_the_runs_else_v2xvits():
    assert sweep.noise_seed(options(noise_seed=3), {"wild_setting": {"seed": 9}}) == 3
    assert sweep.noise_seed(options(), {"wild_setting": {"seed": 9}}) == 9
    assert sweep.noise_seed(options(), {}) == 25
    with pytest.raises(ConfigError) as exc_info:
        sweep.noise_seed(options(noise_seed=-1), {})
    one_line_error(exc_info, "--noise_seed -1", "2**32")


# ------------------------------------------------------------------------------------------ a level's hypes
RUN_HYPES = {"name": "run", "wild_setting": {"async": True, "async_mode": "real", "async_overhead": 300,
                                             "data_size": 1.06, "seed": 4},
             "noise_setting": {"add_noise": True, "args": {"pos_std": 0.5, "rot_std": 0.5}}}


@pytest.mark.parametrize("mode", [mode for mode in sweep.NOISE_MODES if mode != sweep.HEAL_MODE])
def test_a_level_sets_the_loc_err_and_delay_the_datasets_read(mode):
    noisy = sweep.Level(0.2, 0.4, 0.0, mode)
    hypes = sweep.level_hypes(RUN_HYPES, noisy, seed=25)
    assert hypes["noise_setting"]["add_noise"] is False and RUN_HYPES["noise_setting"]["add_noise"] is True
    assert hypes["wild_setting"]["data_size"] == 1.06  # the run's other keys stay
    wild = wild_setting_from_hypes(hypes, "test")
    assert not wild.delay.enabled and wild.seed == 25
    assert (wild.noise.mode, wild.noise.xy_std, wild.noise.z_std, wild.noise.yaw_std) == (mode, 0.2, 0.2, 0.4)
    assert not wild.noise.include_ego

    delayed = wild_setting_from_hypes(sweep.level_hypes(RUN_HYPES, sweep.Level(0.0, 0.0, 200.0, mode), 25), "t")
    assert delayed.noise is None
    assert (delayed.delay.enabled, delayed.delay.mode, delayed.delay.overhead_ms) == (True, "sim", 200.0)


def test_a_heal_level_sets_noise_setting_as_heals_and_coaligns_inference_w_noise():
    """--noise_mode heal: HEAL's and CoAlign's noise_setting with the level's spreads and zero means (their args
    replaced whole: the run's laplace goes), x, y and yaw of every CAV, the ego included; wild_setting's loc_err off,
    its delay and seed the level's."""
    run = dict(RUN_HYPES, noise_setting={"add_noise": False, "args": {"pos_std": 0.5, "rot_std": 0.5,
                                                                      "laplace": True}},
               wild_setting=dict(RUN_HYPES["wild_setting"], loc_err=True, xyz_std=0.3, ryp_std=0.3))
    hypes = sweep.level_hypes(run, sweep.Level(0.2, 0.4, 0.0, sweep.HEAL_MODE), seed=25)
    assert hypes["noise_setting"] == {"add_noise": True, "args": {"pos_std": 0.2, "rot_std": 0.4, "pos_mean": 0.0,
                                                                  "rot_mean": 0.0}}
    assert hypes["wild_setting"]["loc_err"] is False and hypes["wild_setting"]["data_size"] == 1.06
    wild = wild_setting_from_hypes(hypes, "test")
    assert not wild.delay.enabled and wild.seed == 25
    noise = wild.noise
    assert (noise.mode, noise.xy_std, noise.z_std, noise.yaw_std, noise.xy_mean, noise.yaw_mean) == \
        ("per_sample", 0.2, 0.0, 0.4, 0.0, 0.0)
    assert noise.include_ego and not noise.laplace

    clean = wild_setting_from_hypes(sweep.level_hypes(run, sweep.Level(0.0, 0.0, 0.0, sweep.HEAL_MODE), 25), "t")
    assert clean.noise is None and not clean.delay.enabled
    delayed = wild_setting_from_hypes(sweep.level_hypes(run, sweep.Level(0.0, 0.0, 200.0, sweep.HEAL_MODE), 25), "t")
    assert delayed.noise is None and (delayed.delay.enabled, delayed.delay.overhead_ms) == (True, 200.0)
    assert "the ego included" in sweep.noise_axes(sweep.HEAL_MODE)


def test_a_level_the_run_cannot_take_is_refused_before_any_level_is_evaluated():
    """A delay on DAIR-V2X-C (its splits list single frame pairs): refused by check_levels, which evaluate_levels
    runs before the first level, naming the flag that asked for it. Before, every noise level was evaluated and
    lost, and the line named wild_setting.async, a key the user never set. Every level of an OPV2V run passes."""
    from zoo import hypes_of

    levels = sweep.sweep_levels(options(pos_std=(0.0, 0.4), delays_ms=(0.0, 100.0)))
    with pytest.raises(ConfigError) as info:
        sweep.check_levels(hypes_of("dairv2x/point_pillar_intermediate_fusion"), levels, seed=25)
    one_line_error(info, "--delays_ms 100: the run cannot be evaluated at this level", "DAIR-V2X-C",
                   "leave the level out of the sweep")
    sweep.check_levels(hypes_of("toy/point_pillar_intermediate_fusion"), levels, seed=25)


def test_the_clean_level_reads_true_poses_at_the_egos_timestamp():
    clean = wild_setting_from_hypes(sweep.level_hypes(RUN_HYPES, sweep.Level(0.0, 0.0, 0.0, "upstream"), 25), "t")
    assert clean.noise is None and not clean.delay.enabled


def test_upstream_noise_is_known_to_miss_early_and_late_datasets():
    from opencood_ddp.data.datasets.intermediate_fusion import IntermediateFusionDataset
    from opencood_ddp.data.datasets.late_fusion import LateFusionDataset

    def spec(dataset_class):
        return SimpleNamespace(dataset=dataset_class.__new__(dataset_class))

    upstream, per_sample = sweep.Level(0.2, 0.2, 0.0, "upstream"), sweep.Level(0.2, 0.2, 0.0, "per_sample")
    assert sweep.ignores_the_noise(spec(LateFusionDataset), upstream)
    assert not sweep.ignores_the_noise(spec(IntermediateFusionDataset), upstream)
    assert not sweep.ignores_the_noise(spec(LateFusionDataset), per_sample)
    assert not sweep.ignores_the_noise(spec(LateFusionDataset), sweep.Level(0.2, 0.2, 0.0, "v2xvit"))  # applied
    assert "one offset for every CAV and frame" in sweep.noise_axes("v2xvit")
    assert not sweep.ignores_the_noise(spec(LateFusionDataset), sweep.Level(0.0, 0.0, 100.0, "upstream"))


def test_a_nofusion_sweep_says_that_no_level_can_change_it(caplog):
    """The ego detects alone and the sweep never perturbs or delays the ego: a warning, as for upstream mode's
    early and late datasets; none for a sweep of the clean level alone."""
    with caplog.at_level(logging.WARNING):
        sweep.warn_ego_alone(sweep.sweep_levels(options(pos_std=(0.0,))))
        assert not caplog.records
        sweep.warn_ego_alone(sweep.sweep_levels(options(pos_std=(0.0,), delays_ms=(100.0,))))
    assert "every level equals the clean one" in caplog.text


def frame(*scores: float) -> FrameStats:
    flags = tuple(1 for _ in scores)
    return FrameStats(by_threshold={0.5: DetectionStats(tp=flags, fp=tuple(0 for _ in scores),
                                                        scores=tuple(scores), gt=len(scores))})


def test_the_score_digest_tells_whether_the_detections_changed():
    digest = sweep.WithScoreDigest(lambda frames: {"ap_50": 1.0})
    clean = digest([frame(0.9, 0.5), frame()])
    assert clean["ap_50"] == 1.0 and clean[sweep.DETECTIONS] == 2
    assert digest([frame(0.9, 0.5), frame()])[sweep.SCORE_DIGEST] == clean[sweep.SCORE_DIGEST]
    for other in ([frame(0.9, 0.5000001), frame()], [frame(0.9), frame(0.5)]):
        assert digest(other)[sweep.SCORE_DIGEST] != clean[sweep.SCORE_DIGEST]


# ------------------------------------------------------------------------------------------ the files
def result(ap: float) -> EvalResult:
    summary = {"ap30": ap, "ap_50": ap / 2, "ap_70": ap / 4, sweep.DETECTIONS: 3, sweep.SCORE_DIGEST: f"{ap:.3f}"}
    return EvalResult(summary=summary, frames=4, seconds=0.5, world_size=2)


def written_table(tmp_path: Path, global_sort: bool = False, delays=(100.0,)) -> dict:
    given = options(pos_std=(0.0, 0.4), delays_ms=delays, global_sort=global_sort)
    levels = sweep.sweep_levels(given)
    aps = [0.8, 0.6, math.nan][:len(levels)]
    run = sweep.SweepRun(levels, [result(ap) for ap in aps], Path("RUN/net_epoch3.pth"), "data/test", 25)
    table = sweep.sweep_table(given, run)
    paths = sweep.write_sweep(tmp_path, table)
    stem = "noise_sweep_global_sort" if global_sort else "noise_sweep"
    assert [path.name for path in paths] == [f"{stem}.yaml", f"{stem}.md", f"{stem}.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temporary left
    assert paths[2].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert yaml.safe_load(paths[0].read_text()) == yaml.safe_load(yaml.safe_dump(table))
    return table


def test_rank_0_writes_one_yaml_markdown_and_plot(tmp_path):
    table = written_table(tmp_path)
    assert (table["checkpoint"], table["dataset_dir"], table["world_size"]) == ("net_epoch3.pth", "data/test", 2)
    assert "x, y, z" in table["noise"] and "non-ego" in table["noise"]
    first = table["levels"][0]
    assert first == {"pos_std": 0.0, "rot_std": 0.0, "delay_ms": 0.0, "delay_frames": 0, "mode": "none",
                     "ap30": 0.8, "ap_50": 0.4, "ap_70": 0.2, "frames": 4, "detections": 3, "score_digest": "0.800",
                     "ap_convention": "frame order"}
    assert [e["delay_ms"] for e in table["levels"]] == [0, 0, 100]
    markdown = (tmp_path / "noise_sweep.md").read_text().splitlines()
    assert markdown[2] == ("| pos std (m; x, y, z) | rot std (deg; yaw) | delay (ms) | noise | AP@0.3 | AP@0.5 | "
                           "AP@0.7 | frames |")
    assert markdown[4] == "| 0 | 0 | 0 | none | 0.8000 | 0.4000 | 0.2000 | 4 |"
    assert markdown[5] == "| 0.4 | 0.4 | 0 | per_sample | 0.6000 | 0.3000 | 0.1500 | 4 |"
    assert markdown[6] == "| 0 | 0 | 100 | none | n/a | n/a | n/a | 4 |"  # no ground truth: no AP


def test_a_heal_table_names_its_axes():
    given = options(pos_std=(0.0, 0.4), noise_mode=sweep.HEAL_MODE)
    levels = sweep.sweep_levels(given)
    table = sweep.sweep_table(given, sweep.SweepRun(levels, [result(0.8), result(0.6)], Path("RUN/net_epoch3.pth"),
                                                    "data/test", 25))
    assert "the ego included" in table["noise"] and [e["mode"] for e in table["levels"]] == ["none", "heal"]
    assert sweep.markdown_table(table).splitlines()[2].startswith("| pos std (m; x, y) | rot std (deg; yaw) |")


def test_the_global_sort_table_has_its_own_files(tmp_path):
    table = written_table(tmp_path, global_sort=True, delays=())
    assert table["ap_convention"] == "global sort"
    assert {e["ap_convention"] for e in table["levels"]} == {"global sort"}


def test_the_plot_has_a_delay_panel_only_with_delays():
    levels = [{"pos_std": p, "rot_std": p, "delay_ms": d, "mode": "none" if p == 0 else "per_sample",
               "ap30": 0.5, "ap_50": 0.4, "ap_70": 0.1} for p, d in ((0, 0), (0.2, 0), (0, 300), (0, 100))]
    noise, delay = sweep.sweep_panels(levels)
    assert noise.ticks == ["0/0", "0.2/0.2"] and list(noise.series) == ["AP@0.3", "AP@0.5", "AP@0.7"]
    assert delay.ticks == ["0", "100", "300"]  # sorted by delay, the clean level first
    assert len(sweep.sweep_panels(levels[:2])) == 1
    # --pos_std 0.2 0.4 --delays_ms 0 100: the clean level comes from the delays, and opens the noise axis
    noise, _ = sweep.sweep_panels([levels[1], dict(levels[1], pos_std=0.4, rot_std=0.4), levels[0], levels[3]])
    assert noise.ticks == ["0/0", "0.2/0.2", "0.4/0.4"]


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def toy_run(toy_small, tmp_path_factory) -> Path:
    """AttFuse after one epoch, with a score threshold low enough that it detects (badly): what matters here
    is that noise and delay reach the detections, not how good they are."""
    run_dir = tmp_path_factory.mktemp("noise_sweep") / "attfuse"
    trained = train(0, "--hypes_yaml", REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml",
                    "--model_dir", run_dir, "--num_workers", "0", "--set", "train_params.epoches=1",
                    "--set", "train_params.batch_size=2", "--set", "postprocess.target_args.score_threshold=0.01",
                    *split_set_flags(toy_small))
    assert trained.returncode == 0, explain(trained)
    return run_dir


@pytest.mark.slow
def test_sweep_is_the_same_on_1_and_2_ranks_and_starts_at_inferences_ap(toy_run, toy_small):
    common = ("--model_dir", toy_run, "--fusion_method", "intermediate", "--dataset_dir", toy_small / "test",
              "--num_workers", "0")
    plain = in_process(INFERENCE, *common)
    assert plain.returncode == 0, explain(plain)
    eval_yaml = (toy_run / "eval.yaml").read_bytes()

    levels = ("--pos_std", "0", "0.4", "--delays_ms", "100")
    tables = {}
    for world in (1, 2):
        swept = in_process(SWEEP, *common, *levels) if world == 1 else torchrun(2, SWEEP, *common, *levels)
        assert swept.returncode == 0, explain(swept)
        assert "| pos std (m; x, y, z) | rot std (deg; yaw) | delay (ms) |" in swept.stdout  # rank 0's table
        tables[world] = yaml.safe_load((toy_run / "noise_sweep.yaml").read_text())
        assert tables[world]["world_size"] == world
    assert tables[1]["levels"] == tables[2]["levels"]  # every AP, detection count and digest, bit for bit

    clean, noisy, delayed = tables[1]["levels"]
    assert (clean["mode"], noisy["mode"], delayed["delay_frames"]) == ("none", "per_sample", 1)
    plain_ap = yaml.safe_load(eval_yaml)
    assert [clean[key] for key in ("ap30", "ap_50", "ap_70")] == [plain_ap[key] for key in ("ap30", "ap_50", "ap_70")]
    assert tables[1]["dataset_dir"] == plain_ap["dataset_dir"] == str((toy_small / "test").resolve())  # one name
    assert clean["frames"] == plain_ap["frames"] == 4 and clean["detections"] > 0
    # Noise and delay reach the model's inputs: the detections differ from the clean level's.
    assert noisy["score_digest"] != clean["score_digest"] != delayed["score_digest"]
    assert (toy_run / "eval.yaml").read_bytes() == eval_yaml  # a run never loses what was already saved
    assert (toy_run / "noise_sweep.md").is_file() and (toy_run / "noise_sweep.png").is_file()


@pytest.mark.slow
def test_a_heal_level_is_the_inference_of_a_copy_holding_that_noise_setting(toy_run, toy_small, tmp_path):
    """What docs/robustness.md had users do by hand for HEAL's and CoAlign's setting (a copy of the run whose
    config.yaml holds the level's noise_setting, evaluated by inference_ddp.py) is the sweep's heal level: the same
    APs on the same frames, with the same seed; and its detections are not the clean level's."""
    import shutil

    swept, copied = tmp_path / "swept", tmp_path / "copied"
    for target in (swept, copied):
        shutil.copytree(toy_run, target)
    config = copied / "config.yaml"
    hypes = yaml.safe_load(config.read_text())
    hypes["noise_setting"] = {"add_noise": True, "args": {"pos_std": 0.4, "rot_std": 0.4, "pos_mean": 0.0,
                                                          "rot_mean": 0.0}}
    hypes["wild_setting"] = dict(hypes.get("wild_setting") or {}, seed=7)
    config.write_text(yaml.safe_dump(hypes, sort_keys=False))
    common = ("--fusion_method", "intermediate", "--dataset_dir", toy_small / "test", "--num_workers", "0")
    plain = in_process(INFERENCE, "--model_dir", copied, *common)
    assert plain.returncode == 0, explain(plain)
    level = in_process(SWEEP, "--model_dir", swept, *common, "--pos_std", "0", "0.4", "--noise_mode", "heal",
                       "--noise_seed", "7")
    assert level.returncode == 0, explain(level)
    by_hand = yaml.safe_load((copied / "eval.yaml").read_text())
    clean, entry = yaml.safe_load((swept / "noise_sweep_heal_noise.yaml").read_text())["levels"]
    assert entry["mode"] == "heal" and entry["frames"] == by_hand["frames"] == 4
    assert entry["score_digest"] != clean["score_digest"]  # the noise reached the detections
    assert [entry[key] for key in ("ap30", "ap_50", "ap_70")] == [by_hand[key] for key in ("ap30", "ap_50", "ap_70")]
