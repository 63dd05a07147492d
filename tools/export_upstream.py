#!/usr/bin/env python
"""Write a folder upstream OpenCOOD's scripts load as it is: config.yaml and one net_epoch{N}.pth.

    python tools/export_upstream.py --model_dir RUN --out DIR [--epoch N | --bestval | --step K]

Our run folder holds more than upstream reads, and some of it upstream mishandles: its `load_saved_model` takes
the number after 'epoch' in every *.pth name, so `net_epoch_bestval_at{N}.pth` crashes it, and it sees a folder
of `net_step{K}.pth` only as empty. The export copies config.yaml (without the keys only our runs carry) and the
chosen weights, verified against the model the config builds, under the one name upstream reads.

Upstream's model classes fix some widths in code whatever the config says: the 2-D backbone takes 64 pillar
features, and the detection heads take the backbone's fixed output width. A config with other widths (our toy
configs: 32 pillar features, 192-channel heads) builds a model upstream cannot, and is refused with the reason.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.errors import CheckpointError, ConfigError, run_tool
from opencood_ddp.models import create_model
from opencood_ddp.schema import OWN_KEYS
from opencood_ddp.yaml_parsers import load_parsed_hypes

# Per upstream core_method, the input widths its code fixes: {state_dict key: in-channels (dim 1)}. They equal
# upstream's parameter shapes (tests/test_export_upstream.py checks them against the reference lists).
FIXED_WIDTHS = {
    "point_pillar": {"backbone.blocks.0.1.weight": 64, "cls_head.weight": 384, "reg_head.weight": 384},
    "point_pillar_intermediate": {"backbone.blocks.0.1.weight": 64, "cls_head.weight": 384, "reg_head.weight": 384},
    "point_pillar_fcooper": {"backbone.blocks.0.1.weight": 64, "cls_head.weight": 256, "reg_head.weight": 256},
    "point_pillar_where2comm": {"backbone.blocks.0.1.weight": 64, "cls_head.weight": 256, "reg_head.weight": 256},
}


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
        ours = state[key].shape[1] if key in state else None
        if ours != width:
            problems.append(f"{key} takes {ours} channels, upstream's code fixes {width}")
    return problems


def choose(run: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """(weights file, the N of the exported net_epoch{N}.pth)."""
    if args.bestval:
        found = ckpt.epochs_on_disk(run, ckpt.BESTVAL_RE)
        if not found:
            raise CheckpointError(f"{run} has no net_epoch_bestval_at<N>.pth; drop --bestval")
        return run / ckpt.bestval_name(found[-1]), found[-1]
    if args.step is not None:
        state = ckpt.load_state_file(run / ckpt.step_state_name(args.step))
        return run / ckpt.step_weights_name(args.step), max(1, int(state["epoch"]))
    epochs = ckpt.epochs_on_disk(run)
    if args.epoch is None and not epochs:
        raise CheckpointError(f"{run} has no net_epoch<N>.pth; pass --step K or --bestval (steps on disk: "
                              f"{ckpt.epochs_on_disk(run, ckpt.STEP_WEIGHTS_RE) or 'none'})")
    epoch = args.epoch if args.epoch is not None else epochs[-1]
    return run / ckpt.weights_name(epoch), epoch


def export(args: argparse.Namespace) -> str:
    run, out = Path(args.model_dir), Path(args.out)
    config = run / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"--model_dir {run} is not a run (no config.yaml)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; pass a new or empty folder")
    hypes = load_parsed_hypes(config)
    model = create_model(hypes)
    core_method = hypes["model"]["core_method"]
    problems = width_problems(core_method, model.state_dict())
    if problems:
        raise ConfigError(f"{config} builds a model upstream's code cannot: {'; '.join(problems)}; export a run of "
                          f"a config with upstream's widths (hypes_yaml/opv2v/), not a toy one")
    weights_path, epoch = choose(run, args)
    ckpt.load_weights(model, weights_path)  # the file is this config's model, strictly
    out.mkdir(parents=True, exist_ok=True)
    for key in OWN_KEYS:  # what only this project reads; upstream's loader has no use for them
        hypes.pop(key, None)
    hypes_lib.save_hypes(hypes, out / "config.yaml")
    target = out / ckpt.weights_name(epoch)
    ckpt.atomic_save(model.state_dict(), target)
    return (f"exported {weights_path.name} of {run} as {target} with {out / 'config.yaml'} ({core_method}); "
            f"upstream: python opencood/tools/inference.py --model_dir {out} --fusion_method ...")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: export(args))


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
