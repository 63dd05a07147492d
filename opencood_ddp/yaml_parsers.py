"""Upstream's ``yaml_parser`` step: keys derived from the voxel grid, written into the hypes after loading.

The hypes' ``yaml_parser`` names one of the functions registered here (upstream's names, so its files load
unchanged); ``run_yaml_parser`` imports the hypes' ``imports:`` first, so an out-of-tree parser can be named.

- ``load_point_pillar_params``: ``model.args.point_pillar_scatter.grid_size`` (the BEV grid of the pillars) and
  the anchor grid (PointPillar-family models).
- ``load_voxel_params``: the anchor grid from ``postprocess.anchor_args.cav_lidar_range``, and the same
  ``W``/``H``/``D`` under ``model.args`` (voxel models).
- ``load_second_params``: ``model.args.grid_size`` (the 3-D voxel grid of the sparse backbone) and the anchor
  grid (SECOND).

The anchor grid is ``anchor_args.vw/vh/vd`` (the voxel size) and ``W/H/D``: the number of voxels along x, y, z,
rounded up. Every parser is idempotent: running it on its own output changes nothing (config.yaml of a run is
parsed again on resume).
"""
from __future__ import annotations

import math
import os
from typing import Iterable, List, Sequence

import numpy as np

from opencood_ddp import hypes as hypes_lib
from opencood_ddp.errors import ConfigError
from opencood_ddp.registry import YAML_PARSERS, import_modules

_VOXEL_SIZE = ("preprocess.args.voxel_size", "list")
_ANCHOR_ARGS = ("postprocess.anchor_args", "dict")
# What _anchor_grid writes: declared so that the schema (opencood_ddp/schema.py) knows them in a config.yaml.
_ANCHOR_GRID = tuple((f"postprocess.anchor_args.{key}", kind) for key, kind in (
    ("vw", "number"), ("vh", "number"), ("vd", "number"), ("W", "int"), ("H", "int"), ("D", "int")))
# Each parser's keys it writes whatever the hypes held: its optional keys in the registry (the schema's), and the
# keys a `--set` may not change (DERIVED_KEYS).
_PILLAR_DERIVED = _ANCHOR_GRID + (("model.args.point_pillar_scatter.grid_size", "list"),)
_VOXEL_DERIVED = (("model.args.W", "int"), ("model.args.H", "int"), ("model.args.D", "int")) + _ANCHOR_GRID
_SECOND_DERIVED = _ANCHOR_GRID + (("model.args.grid_size", "list"),)
_GRID_SOURCES = ("preprocess.cav_lidar_range", _VOXEL_SIZE[0])
# parser -> (the keys it derives, the keys it computes them from): a `--set` of a derived key would be overwritten
# without a word, so load_parsed_hypes refuses one that the parser changed.
DERIVED_KEYS = {name: (tuple(key for key, _ in derived), sources) for name, derived, sources in (
    ("load_point_pillar_params", _PILLAR_DERIVED, _GRID_SOURCES),
    ("load_voxel_params", _VOXEL_DERIVED, ("postprocess.anchor_args.cav_lidar_range", _VOXEL_SIZE[0])),
    ("load_second_params", _SECOND_DERIVED, _GRID_SOURCES))}
_ABSENT = object()


def voxel_grid_cells(lidar_range: Sequence[float], voxel_size: Sequence[float]) -> List[int]:
    """(x, y, z) voxels of a range as spconv's voxel generator counts them, and every voxelizer here with it: the
    float32 extent over the float32 voxel size, rounded half away from zero (C's round). The canvas the pillars
    are scattered on must have these cells. Upstream's parser rounds the float64 quotient half to even
    (np.round), one cell fewer where it is a half: a 140.2 m range of 0.4 m voxels is 350.5, spconv's 351 and
    np.round's 350, and the last column's pillars land at the start of the next row."""
    cells = []
    for axis in range(3):
        low, high, size = (np.float32(v) for v in (lidar_range[axis], lidar_range[axis + 3], voxel_size[axis]))
        quotient = float((high - low) / size)
        cells.append(int(math.copysign(math.floor(abs(quotient) + 0.5), quotient)))  # exact: a float32 + 0.5
    return cells


def _anchor_grid(hypes: dict, lidar_range: Sequence[float]) -> dict:
    """``vw, vh, vd`` and ``W, H, D`` of ``postprocess.anchor_args``; returns that mapping."""
    voxel_size = hypes["preprocess"]["args"]["voxel_size"]
    anchor_args = hypes["postprocess"]["anchor_args"]
    anchor_args["vw"], anchor_args["vh"], anchor_args["vd"] = voxel_size
    # Upstream's anchor grid: the float64 quotient rounded up, not the canvas's count (voxel_grid_cells)
    anchor_args["W"], anchor_args["H"], anchor_args["D"] = [
        math.ceil((lidar_range[axis + 3] - lidar_range[axis]) / voxel_size[axis]) for axis in range(3)]
    return anchor_args


@YAML_PARSERS.register("load_point_pillar_params", required=(
        ("preprocess.cav_lidar_range", "list"), _VOXEL_SIZE, ("model.args.point_pillar_scatter", "dict"),
        _ANCHOR_ARGS), optional=_PILLAR_DERIVED)
def load_point_pillar_params(hypes: dict) -> dict:
    lidar_range = hypes["preprocess"]["cav_lidar_range"]
    voxel_size = hypes["preprocess"]["args"]["voxel_size"]
    hypes["model"]["args"]["point_pillar_scatter"]["grid_size"] = voxel_grid_cells(lidar_range, voxel_size)
    _anchor_grid(hypes, lidar_range)
    return hypes


@YAML_PARSERS.register("load_voxel_params", required=(
        _VOXEL_SIZE, _ANCHOR_ARGS, ("postprocess.anchor_args.cav_lidar_range", "list")),
        optional=(("model.args", "dict"),) + _VOXEL_DERIVED)
def load_voxel_params(hypes: dict) -> dict:
    anchor_args = _anchor_grid(hypes, hypes["postprocess"]["anchor_args"]["cav_lidar_range"])
    if "model" in hypes:  # upstream allows hypes without a model (data visualisation)
        hypes["model"].setdefault("args", {}).update({axis: anchor_args[axis] for axis in ("W", "H", "D")})
    return hypes


@YAML_PARSERS.register("load_second_params", required=(
        ("preprocess.cav_lidar_range", "list"), _VOXEL_SIZE, ("model.args", "dict"), _ANCHOR_ARGS),
        optional=_SECOND_DERIVED)
def load_second_params(hypes: dict) -> dict:
    lidar_range = hypes["preprocess"]["cav_lidar_range"]
    voxel_size = hypes["preprocess"]["args"]["voxel_size"]
    hypes["model"]["args"]["grid_size"] = voxel_grid_cells(lidar_range, voxel_size)
    _anchor_grid(hypes, lidar_range)
    return hypes


def run_yaml_parser(hypes: dict, source: str = "hypes") -> dict:
    """The hypes' ``imports:`` imported, then its ``yaml_parser`` applied (in place; also returned)."""
    import_modules(hypes, source)
    name = hypes.get("yaml_parser")
    if name is None:
        return hypes
    entry = YAML_PARSERS.get(name, source)
    entry.validate(hypes, source)
    _check_grid_inputs(hypes, source)
    try:
        return entry.obj(hypes)
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError) as exc:
        keys = ", ".join(key for key, _ in entry.required)
        raise ConfigError(f"{source}: yaml_parser {name} cannot compute the grid from {keys} "
                          f"({type(exc).__name__}: {exc}); fix the hypes") from None


def _check_grid_inputs(hypes: dict, source: str) -> None:
    """The ranges and the voxel size the grids come from, each named where it is wrong: a grid computed from them
    would fail, or come out negative, under keys the parser derives (anchor_args.W, grid_size)."""
    for key in ("preprocess.cav_lidar_range", "postprocess.anchor_args.cav_lidar_range"):
        if hypes_lib.get_key(hypes, key) is not None:
            hypes_lib.range6(hypes, key, source)
    voxel_size = hypes_lib.get_key(hypes, _VOXEL_SIZE[0])
    positive, _ = hypes_lib.KIND_CHECKS["positive_number"]
    if voxel_size is not None and not (
            isinstance(voxel_size, (list, tuple)) and len(voxel_size) == 3 and all(map(positive, voxel_size))):
        raise ConfigError(f"{source}: key {_VOXEL_SIZE[0]} must be 3 positive numbers [x, y, z] in metres, got "
                          f"{voxel_size!r}; {hypes_lib.HYPES_FIX}")


def load_parsed_hypes(path: str | os.PathLike, overrides: Iterable[str] = ()) -> dict:
    """The one way a hypes file is read, for training, evaluation and every tool: loaded, `--set` overrides
    applied in order, the keys a run wrote about itself dropped (hypes.RUN_KEYS), the ``imports:`` imported, the
    ``yaml_parser`` run, and the engine's keys validated. Each step's error is one ConfigError naming the file."""
    source = str(path)
    hypes = hypes_lib.apply_overrides(hypes_lib.load_hypes(path), overrides)
    for key in hypes_lib.RUN_KEYS:
        hypes.pop(key, None)
    hypes = run_yaml_parser(hypes, source)
    check_overrides_kept(hypes, overrides, source)
    hypes_lib.validate(hypes, hypes_lib.ENGINE_KEYS, source, hypes_lib.ENGINE_OPTIONAL_KEYS)
    return hypes


def check_overrides_kept(hypes: dict, overrides: Iterable[str], source: str) -> None:
    """One ConfigError for a `--set` of a key the hypes' yaml_parser derives (DERIVED_KEYS) to another value than
    the parser gave it: the run would train with the parser's value, not the one asked for. The same value, or a
    mapping set above such a key without it, is kept."""
    name = hypes.get("yaml_parser")
    if name not in DERIVED_KEYS:
        return
    keys, sources = DERIVED_KEYS[name]
    for text in overrides:
        parts, value = hypes_lib.split_override(text)
        for key in keys:
            path = key.split(".")
            if path[:len(parts)] == parts:  # set at or above the derived key
                asked, compared = _below(value, path[len(parts):]), path
            elif parts[:len(path)] == path:  # set inside it: an entry of grid_size
                asked, compared = value, parts
            else:
                continue
            derived = _below(hypes, compared)
            if asked is not _ABSENT and asked != derived:
                raise ConfigError(f"{source}: --set {text.strip()}: yaml_parser {name} derives {key} from "
                                  f"{' and '.join(sources)} ({'.'.join(compared)} is {derived!r} here); set those "
                                  f"instead")


def _below(node, parts: Sequence[str]):
    """The value at `parts` under `node` (mapping keys and list indices), or _ABSENT."""
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
    return node


__all__ = ["DERIVED_KEYS", "check_overrides_kept", "load_point_pillar_params", "load_voxel_params",
           "load_second_params", "run_yaml_parser", "load_parsed_hypes"]
