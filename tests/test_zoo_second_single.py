"""second (SECOND for early and late fusion, upstream ``opencood/models/second.py``): upstream's parameters, a
training step on each fusion's toy batch, the batch taken from the data, and an evaluation of each fusion.

The zoo's shared contracts (batch independence, state-dict round trip, the 2-rank DDP step) run for the two toy
configs in tests/test_zoo_contracts.py, which takes every toy config; the sparse backbone and spconv's fixes,
which both SECOND models share, in tests/test_zoo_second.py.

Upstream's reference list: `second` builds MeanVFE, VoxelBackBone8x, HeightCompression, BaseBEVBackbone and the two
heads in that order; `second_intermediate` builds the same with AttBEVBackbone, whose blocks and deblocks carry
BaseBEVBackbone's names and whose per-level attention has no parameters. Upstream's second_early_fusion.yaml and
second_late_fusion.yaml give the model the same mean_vfe, backbone_3d, height_compression, base_bev_backbone and
anchor numbers as second_intermediate_fusion.yaml (only the range differs in late fusion, which sizes no
parameter), so `second`'s names, order and shapes are the second_intermediate reference list.
"""
from __future__ import annotations

import math

import pytest
import torch
import yaml

from launch import REPO, in_process
from zoo import (assert_forward_backward, assert_key_error, assert_upstream_checkpoint_loads, hypes_of,
                 reference_shapes, toy_batch)

from opencood_ddp.hypes import save_hypes
from opencood_ddp.models import create_model
from opencood_ddp.models.communication import bytes_per_cav_frame

FUSIONS = ("early", "late")
OPV2V = {fusion: REPO / "hypes_yaml" / "opv2v" / f"second_{fusion}_fusion.yaml" for fusion in FUSIONS}
TOY = {fusion: REPO / "hypes_yaml" / "toy" / f"second_{fusion}_fusion.yaml" for fusion in FUSIONS}
INTERMEDIATE = REPO / "hypes_yaml" / "opv2v" / "second_intermediate_fusion.yaml"
# The module docstring derives it: upstream's Second has second_intermediate's parameters for these configs.
DERIVED_REFERENCE = "second_intermediate"
INFERENCE = REPO / "tools" / "inference_ddp.py"


# ------------------------------------------------------------------------------------------- upstream's names
@pytest.mark.parametrize("fusion", FUSIONS)
def test_full_size_state_dict_is_upstreams(fusion):
    hypes = hypes_of(OPV2V[fusion])
    assert hypes["model"]["core_method"] == "second"
    ours = [(name, list(tensor.shape)) for name, tensor in create_model(hypes).state_dict().items()]
    assert ours == reference_shapes(DERIVED_REFERENCE)  # names, order and shapes
    # The sparse grid of upstream's range at 0.1 m (load_second_params): late fusion's range is half as long.
    assert hypes["model"]["args"]["grid_size"] == {"early": [2816, 800, 40], "late": [1408, 800, 40]}[fusion]


@pytest.mark.parametrize("fusion", FUSIONS)
def test_upstream_checkpoint_loads_strictly(fusion):
    assert_upstream_checkpoint_loads(OPV2V[fusion], DERIVED_REFERENCE)


def test_the_model_section_is_second_intermediates_but_for_the_core_method():
    """The fact the reference list rests on, checked on our copies of upstream's values."""
    sections = [hypes_of(path)["model"] for path in (OPV2V["early"], OPV2V["late"], INTERMEDIATE)]
    for model in sections:
        model["args"].pop("grid_size")  # the range's, not a parameter's
        model["args"].pop("lidar_range")
    assert [model.pop("core_method") for model in sections] == ["second", "second", "second_intermediate"]
    assert sections[0] == sections[1] == sections[2]


# ------------------------------------------------------------------------------------------- toy model
@pytest.mark.parametrize("fusion", FUSIONS)
def test_toy_training_step_gives_finite_loss_and_every_parameter_a_gradient(toy_small, fusion):
    """assert_forward_backward: a finite loss, a finite gradient on every parameter, zero only where reported
    unused (nothing here); then one map per sample on the anchors' grid."""
    out = assert_forward_backward(TOY[fusion], toy_small)
    anchor = hypes_of(TOY[fusion])["postprocess"]["anchor_args"]
    rows, cols = anchor["H"] // anchor["feature_stride"], anchor["W"] // anchor["feature_stride"]
    assert out["psm"].shape == (2, 2, rows, cols) and out["rm"].shape == (2, 14, rows, cols)


@pytest.mark.parametrize("declared, samples", [(2, 1), (1, 2)])
def test_upstreams_batch_size_is_not_read_the_maps_are_the_samples(toy_small, declared, samples):
    """Upstream makes model.args.batch_size maps whatever the batch holds: a batch of 1 under its configs' 2 gets
    a second, empty map (its evaluation then fails the post-processor's one-sample assertion). Here a batch of n
    samples gives n maps, and the declared value changes nothing."""
    batch, model, _ = toy_batch(TOY["early"], toy_small, samples, f"model.args.batch_size={declared}")
    with torch.no_grad():
        out = model.eval()(batch["ego"])
    assert out["psm"].shape[0] == out["rm"].shape[0] == samples


def test_a_batch_without_labels_counts_its_maps_from_the_voxels(toy_small):
    """Without object_bbx_center (a bare model call) the maps are the voxels' batch indices, as the pillar
    scatter counts them."""
    batch, model, _ = toy_batch(TOY["late"], toy_small)
    bare = {"processed_lidar": batch["ego"]["processed_lidar"]}
    with torch.no_grad():
        assert torch.equal(model.eval()(bare)["psm"], model(batch["ego"])["psm"])


def test_early_and_late_fusion_send_no_map_and_refuse_compression():
    assert bytes_per_cav_frame(hypes_of(OPV2V["early"])) is None
    assert bytes_per_cav_frame(hypes_of(OPV2V["late"])) is None
    assert_key_error(TOY["early"], "model.args.base_bev_backbone.compression=1",
                     "model.args.base_bev_backbone.compression")


# ------------------------------------------------------------------------------------------- evaluation
def _run_folder(folder, config, toy_small):
    """A run folder as training leaves it: config.yaml and net_epoch1.pth. The heads are set so that every
    anchor scores 0.5 and its box is the anchor itself (class weights 0 and bias 0, box residuals 0): every
    frame then has detections, which go through decoding, NMS and the AP, with no training."""
    hypes = hypes_of(config, toy_root=toy_small)
    folder.mkdir()
    save_hypes(dict(hypes, batch_plan={"global_batch": 2}), folder / "config.yaml")
    torch.manual_seed(0)
    state = create_model(hypes).state_dict()
    for name in ("cls_head.weight", "cls_head.bias", "reg_head.weight", "reg_head.bias"):
        state[name] = torch.zeros_like(state[name])
    torch.save(state, folder / "net_epoch1.pth")
    return folder


@pytest.mark.parametrize("fusion", FUSIONS)
def test_evaluation_on_the_toy_world_writes_eval_yaml(toy_small, tmp_path, fusion):
    """tools/inference_ddp.py in this process: late fusion calls the model once per CAV (a batch of one, which
    upstream's batch_size 2 would double), early fusion once per frame."""
    run = _run_folder(tmp_path / "run", TOY[fusion], toy_small)
    result = in_process(INFERENCE, "--model_dir", run, "--fusion_method", fusion,
                        "--dataset_dir", toy_small / "test", "--num_workers", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    found = yaml.safe_load((run / "eval.yaml").read_text())
    assert (found["fusion_method"], found["frames"], found["checkpoint"]) == (fusion, 4, "net_epoch1.pth")
    for key in ("ap30", "ap_50", "ap_70"):
        assert math.isfinite(found[key]) and 0 <= found[key] <= 1, (key, found[key])
    # Upstream's curves: one precision and recall per detection of the split, between VOC's two end points; the
    # anchors left by NMS reached the metric.
    for key in ("mpre_50", "mrec_50", "mpre_70", "mrec_70"):
        assert len(found[key]) > 2 and all(0 <= value <= 1 for value in found[key]), key
