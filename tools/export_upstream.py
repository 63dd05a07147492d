#!/usr/bin/env python
"""Write a folder upstream OpenCOOD's scripts load as it is: config.yaml and one net_epoch{N}.pth.

    python tools/export_upstream.py --model_dir RUN --out DIR [--epoch N | --bestval | --step K]

Our run folder holds more than upstream reads, and some of it upstream mishandles: its `load_saved_model` takes
the number after 'epoch' in every *.pth name, so `net_epoch_bestval_at{N}.pth` crashes it, and it sees a folder
of `net_step{K}.pth` only as empty. The export copies config.yaml (without the keys only our runs carry) and the
chosen weights, verified against the model the config builds, under the one name upstream reads.

Upstream's model classes fix some widths in code whatever the config says (`FIXED_WIDTHS`): the pillar models'
2-D backbone takes 64 pillar features, the naive compressor (model.args.compression) and V2X-ViT's split attention
256 channels, the heads 384 (point_pillar, AttFuse), 256 (F-Cooper, V2VNet, V2X-ViT, CoBEVT; Where2comm's read the
config) or 512 (SECOND), and SECOND's sparse 3-D backbone has fixed widths and feeds a 2-D backbone that takes 256.
A config with other widths (our toy configs: 32 pillar features, 32- to 192-channel heads) builds a model upstream
cannot, and is refused with the reason. So is a core_method without an entry: the V2V4Real fork's point_pillar_opv2v,
which upstream OpenCOOD lacks, or a model of your own; and a model with layers only the forks build (`FORK_LAYERS`:
the forks' shrink header on point_pillar, V2VNet's temporal encoding, the direction classifier), which upstream's
strict=False loading would drop without a word. SECOND early and late fusion's config is written with
model.args.batch_size 1, the maps a call of upstream's inference gives its Second. A name the forks give one of
upstream's models (`OPENCOOD_NAMES`: V2V4Real's point_pillar_fax, upstream's CoBEVT) is written as upstream's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.engine.inference import load_run
from opencood_ddp.engine.run_dir import CONFIG_NAME
from opencood_ddp.errors import ConfigError, run_tool
from opencood_ddp.models import create_model
from opencood_ddp.schema import OWN_KEYS

# Upstream's literals (its opencood/models/*.py and sub_modules/): the pillar models' BaseBEVBackbone(..., 64), the
# NaiveCompressor(256, ratio) of model.args.compression, V2X-ViT's SplitAttn(256), the heads' nn.Conv2d(128 * 3 |
# 128 * 2 | 256 * 2, ...), SECOND's VoxelBackBone8x (4 point features in; 16, 32, 64, 64 channels; conv_out takes
# 64) and AttBEVBackbone(..., 256). Our models take most of these widths from the config, so the config decides
# whether upstream can build the model; the sparse backbone's widths are fixed here too, and listed so that they
# stay checked should ours ever read them from the config.
_PILLARS_IN = {"backbone.blocks.0.1.weight": 64}
_COMPRESSOR_IN = {"naive_compressor.encoder.0.weight": 256, "naive_compressor.decoder.3.weight": 256}
_SPLIT_ATTN = "fusion_net.encoder.layers.0.0.layers.0.1.fn.split_attn."
_SPARSE_3D_IN = {f"backbone_3d.{layer}.weight": width for layer, width in (
    ("conv_input.0", 4), ("conv1.0.0", 16), ("conv2.0.0", 16), ("conv2.1.0", 32), ("conv2.2.0", 32),
    ("conv3.0.0", 32), ("conv3.1.0", 64), ("conv3.2.0", 64), ("conv4.0.0", 64), ("conv4.1.0", 64),
    ("conv4.2.0", 64), ("conv_out.0", 64))}


def _heads(width: int) -> dict:
    return {"cls_head.weight": width, "reg_head.weight": width}


# SECOND with and without AttFuse (early and late fusion): one detector, the fusion has no parameters.
_SECOND = {**_SPARSE_3D_IN, "backbone_2d.blocks.0.1.weight": 256, **_heads(512)}


# Per upstream core_method, the input widths its code fixes: {state_dict key: input channels, see `in_channels`}.
# They equal upstream's parameter shapes (tests/test_export_upstream.py checks them against the reference lists).
FIXED_WIDTHS = {
    "point_pillar": {**_PILLARS_IN, **_heads(384)},
    "point_pillar_intermediate": {**_PILLARS_IN, **_heads(384)},
    "point_pillar_fcooper": {**_PILLARS_IN, **_COMPRESSOR_IN, **_heads(256)},
    # Where2comm's heads read model.args.head_dim: a width of the config, not of upstream's code.
    "point_pillar_where2comm": {**_PILLARS_IN, **_COMPRESSOR_IN},
    "point_pillar_v2vnet": {**_PILLARS_IN, **_COMPRESSOR_IN, **_heads(256)},
    # Every block's split attention has the one width (ours: cav_att_config.dim), so the first block stands for all.
    "point_pillar_transformer": {**_PILLARS_IN, **_COMPRESSOR_IN, _SPLIT_ATTN + "fc1.weight": 256,
                                 _SPLIT_ATTN + "fc2.weight": 256, **_heads(256)},
    "point_pillar_cobevt": {**_PILLARS_IN, **_COMPRESSOR_IN, **_heads(256)},
    "second": _SECOND,
    "second_intermediate": _SECOND,
}
# Layers a config may leave out (model.args.compression 0, V2X-ViT's fusion_method naive): upstream's model then
# lacks them too (ours carry upstream's names), so their widths are checked only where the model has them.
OPTIONAL_LAYERS = ("naive_compressor.", ".split_attn.")


# Layers the forks build that upstream OpenCOOD's classes do not have: {state-dict prefix: the hypes key that builds
# it, and whose it is}. Upstream's load_saved_model loads with strict=False, so their weights would be dropped
# without a word and upstream would run another model than the one trained.
FORK_LAYERS = {"dir_head.": "model.args.dir_args (HEAL's and CoAlign's direction classifier)"}
FORK_LAYERS_OF = {
    "point_pillar": {"shrink_conv.": "model.args.shrink_header (the V2V4Real fork's and the V2X-ViT repository's "
                                     "point_pillar)"},
    "point_pillar_v2vnet": {"fusion_net.cnn.": "model.args.v2vfusion.use_temporal_encoding (the V2V4Real fork's and "
                                               "the V2X-ViT repository's temporal encoding)"},
}
# The forks' names for upstream's own classes: {the fork's core_method: upstream OpenCOOD's}. The layers, names and
# forward are upstream's (models/point_pillar_cobevt.py), so the export checks and writes upstream's name.
OPENCOOD_NAMES = {"point_pillar_fax": "point_pillar_cobevt"}
# Upstream's Second hands model.args.batch_size to spconv as the number of maps, and its inference feeds one sample
# a call (docs/compatibility.md): the exported config says 1, so that upstream's inference.py runs.
ONE_MAP_A_CALL = ("second",)


def fork_layers(core_method: str, state: dict) -> list[str]:
    """The hypes keys of the layers in `state` that upstream OpenCOOD's class of `core_method` lacks."""
    layers = {**FORK_LAYERS, **FORK_LAYERS_OF.get(core_method, {})}
    return [key for prefix, key in layers.items() if any(name.startswith(prefix) for name in state)]


def in_channels(shape: Sequence[int]) -> int:
    """A weight's input channels: dim 1 of nn.Conv2d's and nn.Linear's ([out, in, ...]); spconv's 3-D convolutions,
    the only 5-D weights listed, keep them last ([out, kz, ky, kx, in]). No transposed convolution ([in, out, ...])
    is listed: upstream's code takes their widths from the config."""
    return shape[-1] if len(shape) == 5 else shape[1]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="our run folder (config.yaml and checkpoints)")
    parser.add_argument("--out", required=True, help="a new or empty folder for upstream")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--epoch", type=int, help="export net_epoch{N}.pth (default: the newest epoch checkpoint)")
    which.add_argument("--bestval", action="store_true", help="export net_epoch_bestval_at{N}.pth")
    which.add_argument("--step", type=int, help="export net_step{K}.pth (a run stopped mid-epoch)")
    return parser.parse_args(argv)


def width_problems(core_method: str, state: dict) -> list[str]:
    """What upstream's code cannot build of this state dict's widths ([] when it can)."""
    if core_method not in FIXED_WIDTHS:
        return [f"model.core_method {core_method} has no upstream counterpart checked here "
                f"(known: {', '.join(sorted(FIXED_WIDTHS))})"]
    problems = []
    for key, width in FIXED_WIDTHS[core_method].items():
        if key not in state:
            if not any(part in key for part in OPTIONAL_LAYERS):
                problems.append(f"{key} is missing, upstream's code builds it with {width} input channels")
            continue
        ours = in_channels(state[key].shape)
        if ours != width:
            problems.append(f"{key} takes {ours} channels, upstream's code fixes {width}")
    return problems


def exported_epoch(run_dir: Path, checkpoint: Path, step: Optional[int]) -> int:
    """The N of the exported net_epoch{N}.pth: the chosen epoch's; for a step checkpoint, the epoch it was saved in
    (at least 1, upstream's epochs count from 1)."""
    if step is not None:
        state = run_dir / ckpt.step_state_name(step)
        if not state.is_file():
            raise ConfigError(f"{checkpoint.name} has no {state.name} beside it, which says the epoch it was saved in "
                              f"(upstream's files are numbered by epoch); restore it, or export an epoch checkpoint "
                              f"(--epoch N)")
        return max(1, int(ckpt.load_state_file(state)["epoch"]))
    return int((ckpt.WEIGHTS_RE.match(checkpoint.name) or ckpt.BESTVAL_RE.match(checkpoint.name)).group(1))


def check_out(out: Path) -> None:
    """--out is a new or empty folder, or can be made one (its nearest existing parent is a folder)."""
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; pass a new or empty folder")
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file; pass a new or empty folder")


def export(args: argparse.Namespace) -> str:
    run_dir, out = Path(args.model_dir), Path(args.out)
    run = load_run(run_dir, args.epoch, args.bestval, args.step, step_flag="--step")
    check_out(out)
    hypes = run.hypes
    with hypes_lib.naming_file(hypes, run.config):
        model = create_model(hypes)
    core_method = OPENCOOD_NAMES.get(hypes["model"]["core_method"], hypes["model"]["core_method"])
    hypes["model"]["core_method"] = core_method
    forks = fork_layers(core_method, model.state_dict())
    if forks:
        raise ConfigError(f"{run_dir / CONFIG_NAME} builds layers upstream OpenCOOD's {core_method} does not have: "
                          f"{'; '.join(forks)}; upstream would load the weights without them (strict=False) and run "
                          f"another model: evaluate the run here, or in the repository the config comes from")
    problems = width_problems(core_method, model.state_dict())
    if problems:
        raise ConfigError(f"{run_dir / CONFIG_NAME} builds a model upstream's code cannot: {'; '.join(problems)}; "
                          f"export a run of a config with upstream's widths (hypes_yaml/opv2v/), not a toy one")
    epoch = exported_epoch(run_dir, run.checkpoint, args.step)
    ckpt.load_weights(model, run.checkpoint)  # the file is this config's model, strictly
    out.mkdir(parents=True, exist_ok=True)
    for key in OWN_KEYS:  # what only this project reads; upstream's loader has no use for them
        hypes.pop(key, None)
    if core_method in ONE_MAP_A_CALL and "batch_size" in hypes["model"]["args"]:
        hypes["model"]["args"]["batch_size"] = 1
    hypes_lib.save_hypes(hypes, out / CONFIG_NAME)
    target = out / ckpt.weights_name(epoch)
    ckpt.atomic_save(model.state_dict(), target)
    return (f"exported {run.checkpoint.name} of {run_dir} as {target} with {out / CONFIG_NAME} ({core_method}); "
            f"upstream: python opencood/tools/inference.py --model_dir {out} --fusion_method ...")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: export(args))


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
