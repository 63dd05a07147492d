"""The benchmark configs of the real-world data sets: hypes_yaml/dairv2x/ (CoAlign's and HEAL's DAIR-V2X-C values)
and hypes_yaml/v2v4real/ (the rows of V2V4Real's README table, with its fork's values).

In process, for every file of both folders:
- it loads, passes the schema check with the task's keys, selects its data set's reader with valid keys, and its
  model, post-processor and loss build at the file's real sizes;
- the values that decide what a table row measures are the anchors': the data set, the split files, the areas
  (V2V4Real's GT_RANGE; CoAlign's gt_range = cav_lidar_range), the labels, and the fork's training augmentation;
- it trains (slow): one step of one training sample from the data set's toy copy (conftest's toy_dairv2x /
  toy_v2v4real) at the file's real model size gives a finite loss and finite gradients.
"""
from __future__ import annotations

import pytest
import torch

from launch import REPO
from zoo import hypes_of
from opencood_ddp.data.datasets import NO_FUSION, fusion_methods
from opencood_ddp.data.ground_truth import evaluation_gt_range
from opencood_ddp.data.sources import source_entry
from opencood_ddp.loss import create_loss
from opencood_ddp.models import create_model
from opencood_ddp.postprocess import create_postprocessor
from opencood_ddp.schema import check_known_keys
from opencood_ddp.tasks.opencood import TASK_KEYS, build_task

FOLDERS = ("dairv2x", "v2v4real")
ROWS = ("point_pillar_late_fusion", "point_pillar_early_fusion", "point_pillar_intermediate_fusion",
        "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt")
# V2V4Real's fork has a second AttFuse file (point_pillar_opv2v: attention over the shrunk map, 32x compressed).
EXPECTED = {"dairv2x": set(ROWS) | {"point_pillar_where2comm"}, "v2v4real": set(ROWS) | {"point_pillar_opv2v"}}
CONFIGS = [REPO / "hypes_yaml" / folder / f"{stem}.yaml" for folder in FOLDERS for stem in sorted(EXPECTED[folder])]
IDS = [f"{path.parent.name}/{path.stem}" for path in CONFIGS]

# V2V4Real's GT_RANGE (its fork's data_utils/datasets/__init__.py): the area every row is evaluated on.
V2V4REAL_GT_RANGE = (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0)
# CoAlign's DAIR-V2X PointPillar range, its gt_range in every lidar_only_with_noise/pointpillar_*.yaml.
COALIGN_RANGE = (-100.8, -40.0, -3.5, 100.8, 40.0, 1.5)
# (cav_lidar_range, gt_range) where a DAIR file does not evaluate on its own cav_lidar_range = COALIGN_RANGE:
# CoAlign's V2X-ViT widens x and narrows y for its windows and keeps the other rows' area; HEAL's CoBEVT is HEAL's.
DAIR_AREAS = {
    "point_pillar_v2xvit": ((-102.4, -38.4, -3.5, 102.4, 38.4, 1.5), COALIGN_RANGE),
    "point_pillar_cobevt": ((-102.4, -51.2, -3.5, 102.4, 51.2, 1.5), (-102.4, -51.2, -3.5, 102.4, 51.2, 1.5)),
}
DAIR_DATA_DIR = "dataset/my_dair_v2x/v2x_c/cooperative-vehicle-infrastructure"  # HEAL's and CoAlign's layout


def floats(values) -> tuple:
    return tuple(float(v) for v in values)


def test_each_folder_holds_its_table_rows():
    for folder in FOLDERS:
        found = {path.stem for path in (REPO / "hypes_yaml" / folder).glob("*.yaml")}
        assert found == EXPECTED[folder], folder


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_passes_the_schema_and_builds_at_full_size(path):
    hypes = hypes_of(path)
    check_known_keys(hypes, str(path), extra=TASK_KEYS)
    assert path.read_text().startswith("# "), "the header says which anchor file and values it follows"
    assert hypes["fusion"]["dataset"] == path.parent.name
    source_entry(hypes)  # the data set's own keys and values (DAIR: label_type, input_source, comm_range, ...)
    create_postprocessor(hypes, train=False)
    create_loss(hypes)
    model = create_model(hypes)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 6_000_000  # the real PointPillar sizes


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.parent.name == "v2v4real"],
                         ids=[i for i in IDS if i.startswith("v2v4real")])
def test_v2v4real_config_keeps_the_forks_evaluation_area_splits_and_augmentation(path):
    hypes = hypes_of(path)
    assert evaluation_gt_range(hypes, str(path)) == V2V4REAL_GT_RANGE
    assert create_postprocessor(hypes, train=False).gt_range == V2V4REAL_GT_RANGE
    assert (hypes["root_dir"], hypes["validate_dir"], hypes["test_dir"]) == \
           ("v2v4real/train", "v2v4real/validate", "v2v4real/test")
    wild = hypes["wild_setting"]
    assert wild["async"] is False and wild["loc_err"] is False and wild["seed"] == 20  # the README's Sync columns
    if hypes["fusion"]["core_method"] == "IntermediateFusionDataset":  # the fork projects first and augments
        assert hypes["fusion"]["args"] == {"proj_first": True, "augment": True}


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.parent.name == "dairv2x"],
                         ids=[i for i in IDS if i.startswith("dairv2x")])
def test_dairv2x_config_keeps_the_anchors_data_layout_and_evaluation_area(path):
    hypes = hypes_of(path)
    cav_range = floats(hypes["postprocess"]["anchor_args"]["cav_lidar_range"])
    gt_range = floats(hypes["postprocess"]["gt_range"])
    assert (cav_range, gt_range) == DAIR_AREAS.get(path.stem, (COALIGN_RANGE, COALIGN_RANGE))
    assert evaluation_gt_range(hypes, str(path)) == gt_range
    assert hypes["data_dir"] == DAIR_DATA_DIR
    assert (hypes["root_dir"], hypes["validate_dir"], hypes["test_dir"]) == \
           tuple(f"{DAIR_DATA_DIR}/{name}" for name in ("train.json", "val.json", "val.json"))
    assert (hypes["comm_range"], hypes["input_source"], hypes["label_type"]) == (100, ["lidar"], "lidar")
    if "wild_setting" in hypes:
        assert not hypes["wild_setting"].get("async", False)  # DAIR-V2X-C pairs have no earlier frame


@pytest.mark.parametrize("folder", FOLDERS)
def test_late_fusion_run_is_also_the_no_fusion_row(folder):
    hypes = hypes_of(f"{folder}/point_pillar_late_fusion")
    assert fusion_methods()[NO_FUSION] == hypes["fusion"]["core_method"] == "LateFusionDataset"


# ------------------------------------------------------------------------------------------------ training


def informative_batch(task) -> dict:
    """A one-sample training batch with positive anchors, and with two CAVs where the dataset fuses them: the
    first such sample of the training split (the toy copies' first samples may hold one CAV, or, in late fusion,
    a CAV whose own labels are empty)."""
    for index in range(len(task.train_set)):
        batch = task.collate_train([task.train_set[index]])
        ego = batch["ego"]
        cavs = int(ego["record_len"].sum()) if ego.get("record_len") is not None else 2
        if int(ego["label_dict"]["pos_equal_one"].sum()) > 0 and cavs >= 2:
            return batch
    pytest.fail("no training sample of the toy copy has positive anchors and two CAVs")


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_config_trains_one_step_on_the_toy_copy(path, request):
    folder = path.parent.name  # the file read on its data set's toy copy (conftest's toy_dairv2x, toy_v2v4real)
    hypes = hypes_of(path, toy_root=request.getfixturevalue(f"toy_{folder}"), layout=folder)
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)  # checks the keys again, with the toy data's paths
    out = task.step(task.model, informative_batch(task))
    out.total.backward()
    assert torch.isfinite(out.total), f"loss {out.total.item()}"
    assert all(torch.isfinite(part).all() for part in out.parts.values()), out.parts
    trained = [(name, p) for name, p in task.model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trained if p.grad is None]
    bad = [name for name, p in trained if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not missing and not bad, f"no gradient: {missing[:5]}, non-finite gradient: {bad[:5]}"
