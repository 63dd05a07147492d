"""The V2V4Real fork's point_pillar_opv2v: F-Cooper's pipeline with one attention fusion over the shrunk maps.
Its state dict is upstream F-Cooper's (compressed 32x as the fork's file), so checkpoints move between the two;
with one CAV both fusions give that CAV's map, with two they differ (attention is not the max); it trains."""
from __future__ import annotations

import ast

import torch

from zoo import REPO, assert_zero_gradients_are_the_unused_groups, hypes_of, lone_cav, toy_batch, toy_samples
from opencood_ddp.models import create_model
from opencood_ddp.models.modules.fusion import AttFusion

FORK_FILE = REPO / "hypes_yaml" / "v2v4real" / "point_pillar_opv2v.yaml"
FCOOPER_32 = REPO / "tests" / "reference" / "opencood_state_dict" / "compression32" / "point_pillar_fcooper.tsv"
TOY_FCOOPER = REPO / "hypes_yaml" / "toy" / "point_pillar_fcooper.yaml"


def test_the_forks_file_builds_upstream_fcoopers_state_dict_compressed_32x():
    """Names and order are upstream F-Cooper's; so are the shapes but the shrink header's kernel, which follows
    each file's kernal_size (the fork's 3, upstream OpenCOOD's compressed F-Cooper file 1)."""
    model = create_model(hypes_of(FORK_FILE))
    ours = [(name, list(t.shape)) for name, t in model.state_dict().items()]
    theirs = [(name, ast.literal_eval(shape)) for name, shape in (row.split("\t") for row in
                                                                  FCOOPER_32.read_text().splitlines())]
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    kernel = "shrink_conv.layers.0.double_conv.0.weight"
    assert [row for row in ours if row[0] != kernel] == [row for row in theirs if row[0] != kernel]
    assert dict(ours)[kernel] == [256, 384, 3, 3]
    assert isinstance(model.fusion_net, AttFusion)


def test_with_one_cav_attention_and_max_give_the_same_map_and_with_more_they_differ(toy_small):
    """F-Cooper's weights loaded into point_pillar_opv2v (strict: the same state dict)."""
    task, samples = toy_samples(TOY_FCOOPER, toy_small)
    fcooper = task.model.eval()
    attention = create_model(hypes_of(TOY_FCOOPER, "model.core_method=point_pillar_opv2v")).eval()
    attention.load_state_dict(fcooper.state_dict(), strict=True)
    several = task.collate_train(samples[:2])["ego"]
    alone = task.collate_train([lone_cav(sample) for sample in samples[:2]])["ego"]
    assert int(several["record_len"].max()) > 1 and int(alone["record_len"].max()) == 1
    with torch.no_grad():
        assert torch.equal(fcooper(alone)["psm"], attention(alone)["psm"])  # one CAV: its own map either way
        assert not torch.allclose(fcooper(several)["psm"], attention(several)["psm"])


def test_it_trains_every_parameter(toy_small):
    batch, _, task = toy_batch(TOY_FCOOPER, toy_small, 2, "model.core_method=point_pillar_opv2v")
    model = task.model
    assert type(model).__name__ == "PointPillarOPV2V"
    model.train()
    out = task.step(model, batch)
    assert torch.isfinite(out.total)
    out.total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert_zero_gradients_are_the_unused_groups(model)  # none all zero, as the model reports no unused group
