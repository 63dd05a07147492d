"""Feature compression, backbone_fix and the communication volume of the zoo's models.

- compression: at `compression: 32` every model's parameter names, order and shapes equal upstream's
  (tests/reference/opencood_state_dict/compression32, a copy of the shared reference lists); the compressed toy
  models train (every trainable parameter gets a finite gradient) and send the bottleneck that
  `models/communication.py` counts; values that do not fit are one error line.
- backbone_fix: exactly the fusion stays trainable; Adam steps through the engine's optimizer leave every frozen
  parameter bit-identical while the fusion moves, and the frozen BatchNorm layers keep updating their running
  statistics (upstream sets requires_grad alone); a model with nothing left to train is one error line.
- communication volume and Where2comm's two rates, against values worked out by hand.
- one run on real ranks (slow): train, freeze with --set on resume, stop mid-way, resume again.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import zoo
from launch import REPO, explain, split_set_flags, train

from opencood_ddp.errors import ConfigError
from opencood_ddp.models import create_model
from opencood_ddp.models.communication import BOX_BYTES, bytes_per_cav_frame, map_bytes
from opencood_ddp.models.point_pillar import BACKBONE_FIX
from opencood_ddp.registry import MODELS

COMPRESSION32 = REPO / "tests" / "reference" / "opencood_state_dict" / "compression32"
OPV2V, TOY = REPO / "hypes_yaml" / "opv2v", REPO / "hypes_yaml" / "toy"
# core_method -> the stem of its hypes files, for the models upstream compresses with model.args.compression.
NAIVE = {"point_pillar_fcooper": "point_pillar_fcooper", "point_pillar_v2vnet": "point_pillar_v2vnet",
         "point_pillar_cobevt": "point_pillar_cobevt", "point_pillar_transformer": "point_pillar_v2xvit",
         "point_pillar_where2comm": "point_pillar_where2comm"}
ATTFUSE = "point_pillar_intermediate_fusion"
# The models whose fusion has parameters: backbone_fix leaves them something to train.
FUSION_TRAINS = ("point_pillar_v2xvit", "point_pillar_v2vnet", "point_pillar_cobevt")


def reference_rows(core_method: str) -> list:
    rows = (COMPRESSION32 / f"{core_method}.tsv").read_text().splitlines()
    return [(name, ast.literal_eval(shape)) for name, shape in (row.split("\t") for row in rows)]


def shapes(model: torch.nn.Module) -> list:
    return [(name, list(tensor.shape)) for name, tensor in model.state_dict().items()]


def toy_task(stem: str, toy_root: Path, *overrides: str):
    from opencood_ddp.tasks import build_task

    hypes = zoo.hypes_of(TOY / f"{stem}.yaml", *overrides, toy_root=toy_root)
    torch.manual_seed(0)
    return hypes, build_task(hypes, for_training=True)


def first_batch(task, samples: int = 2) -> dict:
    return task.collate_train([task.train_set[i] for i in range(samples)])


def one_line(caught, *fragments: str) -> str:
    message = str(caught.value)
    assert "\n" not in message and message.endswith("; fix the hypes"), message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------------------------------------ names and shapes
@pytest.mark.parametrize("core", sorted(NAIVE))
def test_compression_32_state_dict_equals_upstream_reference(core):
    """naive_compressor sits between shrink_conv and fusion_net (heads for F-Cooper) with upstream's shapes."""
    model = create_model(zoo.hypes_of(OPV2V / f"{NAIVE[core]}.yaml", "model.args.compression=32"))
    assert shapes(model) == reference_rows(core)


def test_attfuse_compression_32_state_dict_equals_upstream_reference():
    """AttFuse's compression is a number of auto-encoder steps: 32, 31 and 30 at the three levels, their channels
    halved down to zero. Upstream builds that model but cannot run it (a 2^32-fold upsampling), so the hypes check
    refuses it; the class itself builds upstream's parameters exactly, which is what a checkpoint holds."""
    hypes = zoo.hypes_of(OPV2V / f"{ATTFUSE}.yaml", "model.args.base_bev_backbone.compression=32")
    with pytest.raises(ConfigError) as caught:
        create_model(hypes)
    one_line(caught, "model.args.base_bev_backbone.compression (32)", "use at most 2")
    with pytest.warns(UserWarning, match="zero-element"):
        model = MODELS.get("point_pillar_intermediate").obj(hypes["model"]["args"])
    assert shapes(model) == reference_rows("point_pillar_intermediate")


def test_attfuse_compression_2_is_the_reference_without_the_deeper_steps():
    """At compression L, level l holds the first L - l steps of the compression-32 reference: derived from the
    reference list, not from our code."""
    model = create_model(zoo.hypes_of(OPV2V / f"{ATTFUSE}.yaml", "model.args.base_bev_backbone.compression=2"))

    def kept(name: str) -> bool:
        parts = name.split(".")
        if parts[1] != "compression_modules":
            return True
        level, step = int(parts[2]), int(parts[4])
        return step < 2 - level

    assert shapes(model) == [row for row in reference_rows("point_pillar_intermediate") if kept(row[0])]


@pytest.mark.parametrize("stem", sorted(NAIVE.values()) + [ATTFUSE])
def test_compression_0_adds_nothing(stem):
    model = create_model(zoo.hypes_of(OPV2V / f"{stem}.yaml"))
    assert not [name for name, _ in shapes(model) if "compress" in name]


# ------------------------------------------------------------------------------------------ compressed models
def sent_tensors(model: torch.nn.Module, multi_scale: bool) -> list:
    """Forward hooks recording what each CAV would send: the compressors' bottlenecks, else level 0 of the
    backbone (Where2comm's multi-scale path sends that map, uncompressed)."""
    found: list = []
    backbone = model.backbone
    if getattr(backbone, "compression_modules", None) is not None:
        modules = [m.encoder[-1] for m in backbone.compression_modules]
        modules += list(backbone.blocks)[len(modules):]  # uncompressed levels send their own output
    elif multi_scale:
        modules = [backbone.blocks[0]]
    else:
        modules = [model.naive_compressor.encoder]
    for module in modules:
        module.register_forward_hook(lambda _m, _i, out: found.append(tuple(out.shape)))
    return found


COMPRESSED = [("point_pillar_fcooper", "model.args.compression=4"), ("point_pillar_v2vnet", "model.args.compression=4"),
              ("point_pillar_cobevt", "model.args.compression=8"), ("point_pillar_v2xvit", "model.args.compression=4"),
              ("point_pillar_where2comm", "model.args.compression=4"),
              (ATTFUSE, "model.args.base_bev_backbone.compression=2")]


@pytest.mark.parametrize("stem, override", COMPRESSED, ids=[s for s, _ in COMPRESSED])
def test_compressed_toy_model_trains_and_sends_what_is_counted(stem, override, toy_small):
    hypes, task = toy_task(stem, toy_small, override)
    multi_scale = bool(hypes["model"]["args"].get("where2comm_fusion", {}).get("multi_scale"))
    model = task.model.train()
    sent = sent_tensors(model, multi_scale)
    batch = first_batch(task, samples=1)  # two CAVs: the fusion and its gradients are exercised
    out = task.step(model, batch)
    out.total.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, p in trainable if p.grad is None] == []
    assert all(torch.isfinite(p.grad).all() for _, p in trainable)
    cavs = int(batch["ego"]["record_len"].sum())
    per_level = sent[:len(sent) // (2 if multi_scale else 1)]  # Where2comm's level 0 runs twice per step
    assert all(shape[0] == cavs for shape in per_level)
    assert map_bytes([shape[1:] for shape in per_level]) == bytes_per_cav_frame(hypes)


def test_where2comm_multi_scale_builds_the_compressor_frozen_and_does_not_run_it(toy_small):
    """Upstream's multi-scale path discards the compressor's output: same weights as upstream's (never moved),
    nothing in the graph that no gradient reaches."""
    _, task = toy_task("point_pillar_where2comm", toy_small, "model.args.compression=4")
    model = task.model.train()
    calls: list = []
    model.naive_compressor.register_forward_hook(lambda *_: calls.append(1))
    task.step(model, first_batch(task)).total.backward()
    assert calls == [] and not any(p.requires_grad for p in model.naive_compressor.parameters())


def test_where2comm_single_scale_compresses_after_the_confidence_map(toy_small):
    """The confidence map (the communication mask) is the uncompressed map's, as upstream's psm_single."""
    _, task = toy_task("point_pillar_where2comm", toy_small, "model.args.compression=4",
                       "model.args.where2comm_fusion.multi_scale=false")
    model = task.model.eval()
    order: list = []
    model.cls_head.register_forward_hook(lambda *_: order.append("cls_head"))
    model.naive_compressor.register_forward_hook(lambda *_: order.append("compressor"))
    with torch.no_grad():
        model(first_batch(task)["ego"])
    assert order == ["cls_head", "compressor", "cls_head"]


# ------------------------------------------------------------------------------------------ refused values
@pytest.mark.parametrize("stem, override, fragments", [
    ("point_pillar_v2xvit", "model.args.compression=3", ("model.args.compression (3) must divide the 64 channels",
                                                          "use one of 2, 4, 8, 16, 32, 64, or 0")),
    ("point_pillar_fcooper", "model.args.compression=-2", ("model.args.compression must be 0 (off) or positive",)),
    ("point_pillar_where2comm", "model.args.compression=128", ("model.args.compression (128) must divide",)),
    ("point_pillar_cobevt", "model.args.base_bev_backbone.compression=1",
     ("model.args.base_bev_backbone.compression > 0 is not built for this model", "model.args.compression")),
    (ATTFUSE, "model.args.base_bev_backbone.compression=3",
     ("level 0 gets 3 halving steps, which needs 2^3 = 8 to divide its 32 channels and both sides of its 60 x 120",
      "use at most 2")),
    # was a ValueError (2^1e9 has too many digits to print), then a count to 1e9 for "at most"
    (ATTFUSE, "model.args.base_bev_backbone.compression=1000000000",
     ("level 0 gets 1000000000 halving steps, which needs 2^1000000000 to divide its 32 channels", "use at most 2")),
    (ATTFUSE, "model.args.compression=4", ("model.args.compression > 0 is not built for this model",
                                           "use model.args.base_bev_backbone.compression")),
    ("point_pillar_early_fusion", "model.args.base_bev_backbone.compression=1",
     ("early and late fusion send no feature map",)),
    ("point_pillar_late_fusion", "model.args.compression=2", ("early and late fusion send no feature map",)),
])
def test_a_compression_that_does_not_fit_is_one_line(stem, override, fragments):
    with pytest.raises(ConfigError) as caught:
        create_model(zoo.hypes_of(TOY / f"{stem}.yaml", override))
    one_line(caught, *fragments)


@pytest.mark.parametrize("stem", ["point_pillar_fcooper", "point_pillar_where2comm", ATTFUSE,
                                  "point_pillar_early_fusion"])
def test_backbone_fix_with_nothing_left_to_train_is_one_line(stem):
    with pytest.raises(ConfigError) as caught:
        create_model(zoo.hypes_of(TOY / f"{stem}.yaml", "model.args.backbone_fix=true"))
    one_line(caught, "model.args.backbone_fix true leaves no parameter of", "set it to false")


def test_second_compresses_in_its_backbone_and_refuses_what_does_not_fit():
    model = create_model(zoo.hypes_of(TOY / "second_intermediate_fusion.yaml",
                                      "model.args.base_bev_backbone.compression=1"))
    assert [name for name in model.state_dict() if "compression_modules" in name][0].startswith(
        "backbone_2d.compression_modules.0.encoder.0.1.weight")
    with pytest.raises(ConfigError) as caught:
        create_model(zoo.hypes_of(TOY / "second_intermediate_fusion.yaml",
                                  "model.args.base_bev_backbone.compression=2"))
    one_line(caught, "model.args.base_bev_backbone.compression (2)", "use at most 1")


# ------------------------------------------------------------------------------------------ backbone_fix
@pytest.mark.parametrize("stem", FUSION_TRAINS)
def test_backbone_fix_leaves_exactly_the_fusion_trainable(stem):
    """Every parameter of BACKBONE_FIX's modules frozen, compressor included; the fusion's as without the flag."""
    free = create_model(zoo.hypes_of(TOY / f"{stem}.yaml", "model.args.compression=4"))
    fixed = create_model(zoo.hypes_of(TOY / f"{stem}.yaml", "model.args.compression=4",
                                      "model.args.backbone_fix=true"))
    fusion = {n for n, p in free.named_parameters() if n.startswith("fusion_net.") and p.requires_grad}
    assert fusion and {n for n, p in fixed.named_parameters() if p.requires_grad} == fusion
    frozen_modules = {n.split(".")[0] for n, p in fixed.named_parameters() if not p.requires_grad}
    # not scatter (no parameters), nor dir_head (built with model.args.dir_args only)
    with_parameters = {name for name in BACKBONE_FIX if list(getattr(fixed, name, torch.nn.Identity()).parameters())}
    assert frozen_modules - {"fusion_net"} == with_parameters
    assert {"naive_compressor", "shrink_conv", "backbone", "cls_head"} <= with_parameters


def test_gloo_sync_batch_norm_keeps_frozen_layers_frozen():
    from opencood_ddp.distributed.sync_bn import GlooSyncBatchNorm, convert_sync_batchnorm

    model = create_model(zoo.hypes_of(TOY / "point_pillar_v2vnet.yaml", "model.args.backbone_fix=true"))
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    converted, kind = convert_sync_batchnorm(model, world_size=2, device="cpu")
    assert kind == "GlooSyncBatchNorm" and any(isinstance(m, GlooSyncBatchNorm) for m in converted.modules())
    assert {n: p.requires_grad for n, p in converted.named_parameters()} == before


def test_adam_steps_leave_frozen_parameters_bit_identical_and_move_the_fusion(toy_small):
    """The engine's optimizer over all parameters (engine/optim.py): a frozen parameter never gets a gradient,
    so Adam (with weight decay) skips it. BatchNorm running statistics of the frozen modules still move."""
    from opencood_ddp.engine.optim import build_optimizer
    from opencood_ddp.engine.trainer import optimizer_step

    hypes, task = toy_task("point_pillar_v2vnet", toy_small, "model.args.compression=4",
                           "model.args.backbone_fix=true")
    model = task.model.train()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = build_optimizer(hypes, model.parameters(), lr=1e-3)
    batch = first_batch(task)
    for _ in range(3):
        task.step(model, batch).total.backward()
        optimizer_step(optimizer, None)
    after = model.state_dict()
    params = dict(model.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    assert frozen and all(torch.equal(after[n], state[n]) for n in frozen)
    moved = [n for n, p in params.items() if p.requires_grad and not torch.equal(after[n], state[n])]
    assert set(moved) == {n for n, p in params.items() if p.requires_grad}
    running = [n for n in after if n.startswith(("backbone.", "naive_compressor.")) and n.endswith("running_mean")]
    assert running and all(not torch.equal(after[n], state[n]) for n in running)


# ------------------------------------------------------------------------------------------ volume and rates
def test_bytes_per_cav_frame_by_hand():
    """V2X-ViT on OPV2V: 704 x 192 grid, level 0 at stride 2 (352 x 96), deblock x1, shrink stride 2: 176 x 48
    cells of 256 float32 values; compression 32 leaves 8 channels. AttFuse: three levels at strides 2, 4, 8 of the
    704 x 200 grid; compression 2 halves level 0 twice and level 1 once, in channels and both sides."""
    v2xvit = OPV2V / "point_pillar_v2xvit.yaml"
    assert bytes_per_cav_frame(zoo.hypes_of(v2xvit)) == 4 * 256 * 48 * 176 == 8_650_752
    assert bytes_per_cav_frame(zoo.hypes_of(v2xvit, "model.args.compression=32")) == 4 * 8 * 48 * 176
    attfuse = OPV2V / f"{ATTFUSE}.yaml"
    assert bytes_per_cav_frame(zoo.hypes_of(attfuse)) == 4 * (64 * 100 * 352 + 128 * 50 * 176 + 256 * 25 * 88)
    assert bytes_per_cav_frame(zoo.hypes_of(attfuse, "model.args.base_bev_backbone.compression=2")) == \
        4 * (16 * 25 * 88 + 64 * 25 * 88 + 256 * 25 * 88)
    where2comm = zoo.hypes_of(OPV2V / "point_pillar_where2comm.yaml", "model.args.compression=32")
    assert bytes_per_cav_frame(where2comm) == 4 * 64 * 96 * 352  # multi-scale: level 0, never compressed
    assert bytes_per_cav_frame(zoo.hypes_of(OPV2V / "point_pillar_late_fusion.yaml")) is None


def test_where2comm_rates_by_hand():
    """Sample 0: ego with 1 of 4 cells above the threshold, one cooperator with 2; sample 1: a lone ego with 4.
    OpenCOOD's com: (3 / 8 + 4 / 4) / 2; ours: the cooperator's 2 of 4 cells."""
    from opencood_ddp.models.modules.where2comm import Communication, Where2commFusion, cav_rows

    high, low = 9.0, -9.0
    psm = torch.full((3, 2, 2, 2), low)
    psm[0, 0, 0, 0] = high
    psm[1, 1, 0, :] = high
    psm[2] = high
    record_len = torch.tensor([2, 1])
    fusion = Where2commFusion([4], "MAX", [-1, -1, -1, 1, 1, 1], Communication(0.5))
    mask, rates = fusion.communicate(psm, cav_rows(record_len, psm.device))
    assert rates.com.item() == pytest.approx((3 / 8 + 1) / 2)
    assert rates.comm_rate.item() == pytest.approx(0.5)
    assert mask[0].sum() == 4 and mask[1].sum() == 2  # the ego whole, the cooperator's two cells
    fully = Where2commFusion([4], "MAX", [-1, -1, -1, 1, 1, 1], Communication(0.5), fully=True)
    _, everything = fully.communicate(psm, cav_rows(record_len, psm.device))
    assert everything.com.item() == everything.comm_rate.item() == 1.0


def test_communication_meter_summaries_by_hand():
    from opencood_ddp.tasks.communication import CommunicationMeter

    def frame(cavs: int) -> dict:
        return {"ego": {"record_len": torch.tensor([cavs])}}

    dense = CommunicationMeter(1000, late=False, score_threshold=0.2)
    frames = [dense.frame({"ego": {"psm": torch.zeros(1)}}, frame(n)) for n in (1, 3, 2)]
    assert dense.summary(frames) == {"bytes_per_cav_frame": 1000.0}
    assert dense.summary([frames[0]]) == {"bytes_per_cav_frame": 1000}  # no cooperator: what one would send
    rated = [dense.frame({"ego": {"comm_rate": torch.tensor(r), "com": torch.tensor(c)}}, frame(n))
             for r, c, n in ((0.5, 0.25, 3), (0.0, 0.5, 1), (0.25, 0.75, 2))]
    summary = dense.summary(rated)
    assert summary["comm_rate"] == pytest.approx((2 * 0.5 + 1 * 0.25) / 3)  # pooled over the 3 cooperators
    assert summary["com"] == pytest.approx(0.5)  # mean over frames
    assert summary["bytes_per_cav_frame"] == pytest.approx(1000 * (2 * 0.5 + 1 * 0.25) / 3)
    assert summary["bytes_per_cav_frame_dense"] == 1000
    late = CommunicationMeter(None, late=True, score_threshold=0.2)
    logits = torch.tensor([[2.0, -2.0], [0.0, -9.0]]).view(1, 1, 2, 2)  # sigmoid: 0.88, 0.12, 0.5, 0.0001
    output = {"ego": {"psm": torch.full((1, 1, 2, 2), 9.0)}, "1": {"psm": logits}, "2": {"psm": logits}}
    assert late.summary([late.frame(output, {})]) == {"bytes_per_cav_frame": 2 * BOX_BYTES}


@pytest.mark.parametrize("stem, keys", [("point_pillar_where2comm", {"comm_rate", "com", "bytes_per_cav_frame_dense"}),
                                        ("point_pillar_late_fusion", set()), ("point_pillar_v2vnet", set())])
def test_evaluation_summary_holds_the_communication(stem, keys, toy_small):
    from opencood_ddp.engine.evaluator import EvalRequest
    from opencood_ddp.tasks.opencood import DetectionEvalOptions, build_eval

    hypes = zoo.hypes_of(TOY / f"{stem}.yaml", toy_root=toy_small)
    fusion = "late" if "late" in stem else "intermediate"
    request = EvalRequest(dataset_dir=str(toy_small / "test"), batch_size=1,
                          task_options=DetectionEvalOptions(fusion))
    spec = build_eval(hypes, request)
    model = spec.model.eval()
    with torch.no_grad():
        records = [record for i in range(2) for record in
                   spec.evaluator.evaluate_batch(model, spec.collate([spec.dataset[i]]), [i])]
    summary = spec.evaluator.metric(records)
    assert {"ap_50", "bytes_per_cav_frame"} | keys <= set(summary)
    if stem == "point_pillar_v2vnet":
        assert summary["bytes_per_cav_frame"] == bytes_per_cav_frame(hypes)
    if keys:
        assert 0 <= summary["comm_rate"] <= 1 and 0 <= summary["com"] <= 1


# ------------------------------------------------------------------------------------------ real ranks
@pytest.mark.slow
def test_backbone_fix_on_resume_freezes_and_stays_frozen_on_two_ranks(toy_small, tmp_path):
    """Toy V2X-ViT, 4 steps an epoch: 1 step (in process: the run the freeze starts from); on 2 ranks, resumed
    with --set model.args.backbone_fix=true
    --allow_config_change to step 3 (stopped mid-epoch by --max_steps); resumed again without the flag to step 6,
    through the end of epoch 1. Every parameter of the frozen modules is bit-identical in the checkpoints from the
    freeze on, the fusion moved in each leg, and config.yaml carries the flag, so the second resume kept the
    freeze. The optimizer (over all parameters, engine/optim.py) resumes the state of the unfrozen leg."""
    import yaml

    from opencood_ddp.checkpoint_files import load_file

    config, run = TOY / "point_pillar_v2xvit.yaml", tmp_path / "run"
    common = ("--hypes_yaml", config, "--model_dir", run, "--num_workers", "0", "--set",
              "train_params.batch_size=2", *split_set_flags(toy_small))
    legs = ((1, ()), (3, ("--set", "model.args.backbone_fix=true", "--allow_config_change")), (6, ()))
    weights = {}
    for world, (steps, flags) in zip((0, 2, 2), legs):
        result = train(world, *common, *flags, "--max_steps", str(steps), timeout=600)
        assert result.returncode == 0, explain(result)
        weights[steps] = load_file(run / f"net_step{steps}.pth")  # read now: the run keeps only its newest
    model = create_model(zoo.hypes_of(config, "model.args.backbone_fix=true"))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and n.split(".")[0] in BACKBONE_FIX]
    fusion = [n for n, p in model.named_parameters() if p.requires_grad]
    assert frozen and fusion
    for a, b in ((1, 3), (3, 6)):
        assert [n for n in frozen if not torch.equal(weights[a][n], weights[b][n])] == [], (a, b)
        assert any(not torch.equal(weights[a][n], weights[b][n]) for n in fusion), (a, b)
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["args"]["backbone_fix"] is True
    # As upstream's: the frozen BatchNorm layers keep updating their running statistics in train mode.
    running = "backbone.blocks.0.2.running_mean"
    assert not torch.equal(weights[3][running], weights[6][running])


def test_the_evaluation_report_names_what_a_cav_sent():
    from opencood_ddp.tasks.opencood import communication_lines, readable_bytes

    assert readable_bytes(8650752) == "8.25 MiB" and readable_bytes(270336) == "264.00 KiB"
    assert readable_bytes(96) == "96 B"
    assert communication_lines({"bytes_per_cav_frame": None}) == []
    line, = communication_lines({"bytes_per_cav_frame": 2 ** 20, "comm_rate": 0.25, "com": 0.5})
    assert line == ("sent per cooperating CAV and frame: 1.00 MiB (Where2comm: comm_rate 0.2500 of the non-ego "
                    "cells; OpenCOOD's com 0.5000)")
