"""Hypes rules that several models share, and the one form of their error line.

Each rule raises ``ConfigError("<hypes file>: <what is wrong and what it must equal>; fix the hypes")`` through
``refuse``, so every model's errors read alike. The map geometry the rules need (the backbone's output channels,
the channels and stride of the map the heads see) is computed here from ``model.args`` with the same rules as
``BaseBEVBackbone`` and ``DownsampleConv``, before anything is built.
"""
from __future__ import annotations

import math
from typing import List, Mapping, NoReturn, Optional, Sequence, Tuple

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import MAX_REPEATS, get_key

ARGS = "model.args."
SHRINK = ARGS + "shrink_header."
SHRINK_LISTS = ("kernal_size", "stride", "padding", "dim")  # upstream's spelling of kernal_size
# The shrink header's keys with their kinds, for a model entry's optional keys; check_shrink_header says the rest.
SHRINK_HEADER_KEYS: Tuple[Tuple[str, str], ...] = (
    ((ARGS + "shrink_header", "dict"),) + tuple((SHRINK + key, "list") for key in SHRINK_LISTS)
    + ((SHRINK + "input_dim", "positive_int"),))
# train_params.max_cav when the hypes leave it out: the datasets' default, as upstream's.
DEFAULT_MAX_CAV = 7


def refuse(source: str, text: str) -> NoReturn:
    raise ConfigError(f"{source}: {text}; fix the hypes")


def positive_ints(values: Sequence) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _non_negative_ints(values: Sequence) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _repeat_counts(values: Sequence) -> bool:
    """Integers in [0, MAX_REPEATS]: how many times each level repeats its convolution."""
    return _non_negative_ints(values) and all(v <= MAX_REPEATS for v in values)


def _deblock_stride(value) -> bool:
    """A deblock's stride: an integer >= 1 (a transposed convolution) or the inverse of one (a strided one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return False
    whole = value if value >= 1 else 1 / value
    return abs(whole - round(whole)) < 1e-6


def check_bev_backbone(args: Mapping, source: str) -> None:
    """base_bev_backbone's lists, before any map size is computed from them (a 0 stride was a ZeroDivisionError, a
    -1 width a negative dimension inside torch): per level an entry of layer_nums (integers >= 0: the extra
    convolutions), layer_strides and num_filters (positive integers); and upsample_strides (deblock strides) with a
    num_upsample_filter (positive integer) each, for no level, every level, or every level and one extra."""
    bev, key = args["base_bev_backbone"], ARGS + "base_bev_backbone."
    levels = len(bev["layer_nums"])
    if not levels or not _repeat_counts(bev["layer_nums"]):
        refuse(source, f"{key}layer_nums must be a non-empty list of integers from 0 to {MAX_REPEATS} (each "
                       f"level's extra convolutions), got {bev['layer_nums']!r}")
    for name in ("layer_strides", "num_filters", "num_upsample_filter"):
        if not positive_ints(bev[name]):
            refuse(source, f"{key}{name} must be a list of positive integers, got {bev[name]!r}")
    if not all(map(_deblock_stride, bev["upsample_strides"])):
        refuse(source, f"{key}upsample_strides must be a list of integers >= 1 or their inverses (0.5: a strided "
                       f"deblock), got {bev['upsample_strides']!r}")
    if not len(bev["layer_strides"]) == len(bev["num_filters"]) == levels:
        refuse(source, f"{key}layer_nums, layer_strides and num_filters must have one entry per level, got "
                       f"{levels}, {len(bev['layer_strides'])} and {len(bev['num_filters'])}")
    deblocks = len(bev["upsample_strides"])
    if deblocks != len(bev["num_upsample_filter"]) or deblocks not in (0, levels, levels + 1):
        refuse(source, f"{key}upsample_strides and num_upsample_filter must have one entry each per deblock: none, "
                       f"one per level ({levels}) or one more; got {deblocks} and {len(bev['num_upsample_filter'])}")


# ------------------------------------------------------------------------------------------ map geometry
def backbone_channels(args: Mapping) -> int:
    """Channels of the base backbone's output (BaseBEVBackbone's rule)."""
    bev = args["base_bev_backbone"]
    return int(sum(bev["num_upsample_filter"])) if bev["num_upsample_filter"] else int(bev["num_filters"][-1])


def shrink_header(args: Mapping) -> Optional[Mapping]:
    """The block of upstream's shrink header, or None when the model has none: the one rule for "is there a shrink
    header", which the map geometry here, the checks and the models' neck (``modules/shrink_neck.py``) all follow.

    The key being there is what counts: the registry has checked that its value is a mapping, and an empty one is
    a header with its keys missing (``check_shrink_header`` refuses it), not a way of saying "none"."""
    return args.get("shrink_header")


def head_channels(args: Mapping) -> int:
    """Channels of the map the heads see: the shrink header's last width, else the backbone's output."""
    shrink = shrink_header(args)
    return int(shrink["dim"][-1]) if shrink is not None else backbone_channels(args)


def head_stride(args: Mapping) -> Optional[float]:
    """Stride of the heads' map over the voxel grid, or None when the backbone adds its extra deblock."""
    bev = args["base_bev_backbone"]
    if len(bev["upsample_strides"]) != len(bev["layer_strides"]):
        return None
    if bev["upsample_strides"]:
        stride = float(bev["layer_strides"][0]) / float(bev["upsample_strides"][0])
    else:
        stride = float(math.prod(bev["layer_strides"]))
    for step in (shrink_header(args) or {}).get("stride", []):
        stride *= float(step)
    return stride


def level_map_sizes(bev: Mapping, rows: int, cols: int) -> List[Tuple[int, int]]:
    """(rows, cols) of each backbone level's output for a (rows, cols) input: ZeroPad2d(1) and a 3x3
    convolution at the level's stride take n cells to (n - 1) // stride + 1."""
    sizes = []
    for stride in bev["layer_strides"]:
        rows, cols = (rows - 1) // int(stride) + 1, (cols - 1) // int(stride) + 1
        sizes.append((rows, cols))
    return sizes


def deblock_cells(n: int, stride: float) -> int:
    """Cells of a deblock's output for n input cells: a transposed convolution multiplies by its upsample stride,
    a strided one (a stride below 1) divides."""
    return n * int(stride) if stride >= 1 else n // int(round(1 / stride))


def shrunk_map_size(args: Mapping) -> Tuple[int, int]:
    """(H, W) of the map the pillar models fuse: the scatter grid through the backbone's first level, its deblock
    (all levels are concatenated at that size), the optional extra deblock and the shrink header's convolutions."""
    backbone = args["base_bev_backbone"]
    stride, ups = int(backbone["layer_strides"][0]), list(backbone.get("upsample_strides", []))

    def through(n: int) -> int:
        n = (n - 1) // stride + 1  # ZeroPad2d(1) + 3x3 convolution
        if not ups:
            for s in backbone["layer_strides"][1:]:
                n = (n - 1) // int(s) + 1
        for up in ups[:1] + ups[len(backbone["layer_strides"]):]:  # level 0's deblock, then the optional extra
            n = deblock_cells(n, up)
        shrink = shrink_header(args) or {}
        for k, s, p in zip(shrink.get("kernal_size", []), shrink.get("stride", []), shrink.get("padding", [])):
            n = (n + 2 * int(p) - int(k)) // int(s) + 1
        return n

    grid = args["point_pillar_scatter"]["grid_size"]
    return through(int(grid[1])), through(int(grid[0]))


def backbone_compression_steps(layers: int, levels: int) -> List[int]:
    """Auto-encoder steps per backbone level for base_bev_backbone.compression = layers: layers - level while
    positive (upstream's AttBEVBackbone), the other levels none."""
    return [max(layers - level, 0) for level in range(levels)]


# ------------------------------------------------------------------------------------------ compression rules
COMPRESSION = ARGS + "compression"
BACKBONE_COMPRESSION = ARGS + "base_bev_backbone.compression"


def _setting(args: Mapping, key: str, source: str) -> int:
    """The value of a compression key (0 when absent); the registry has checked that it is an integer."""
    value = get_key(args, key[len(ARGS):], 0) or 0
    if value < 0:
        refuse(source, f"{key} must be 0 (off) or positive, got {value}")
    return int(value)


def refuse_compression(args: Mapping, source: str, key: str, why: str) -> None:
    """A compression key this model does not build must be 0: it is refused, not ignored."""
    if _setting(args, key, source):
        refuse(source, f"{key} > 0 is not built for this model ({why}); set it to 0")


def check_feature_compression(args: Mapping, source: str) -> None:
    """model.args.compression, the naive compressor of the shrunk map: 0, or a ratio that divides its channels
    (the bottleneck has channels / ratio of them). The backbone's own compression is AttFuse's."""
    refuse_compression(args, source, BACKBONE_COMPRESSION, f"upstream's BaseBEVBackbone ignores it; this model "
                                                           f"compresses with {COMPRESSION}")
    ratio, channels = _setting(args, COMPRESSION, source), head_channels(args)
    if ratio and channels % ratio:
        divisors = [d for d in range(2, channels + 1) if channels % d == 0]
        refuse(source, f"{COMPRESSION} ({ratio}) must divide the {channels} channels of the map it compresses "
                       f"(model.args.shrink_header.dim[-1], else the backbone's output); use one of "
                       f"{', '.join(map(str, divisors[:8]))}{', ...' if len(divisors) > 8 else ''}, or 0 for none")


def _steps_fit(bev: Mapping, sizes: Sequence[Tuple[int, int]], layers: int) -> Optional[str]:
    """Why `layers` auto-encoder steps do not fit the levels (None when they do)."""
    for level, (steps, filters, (rows, cols)) in enumerate(zip(backbone_compression_steps(layers, len(sizes)),
                                                               bev["num_filters"], sizes)):
        # past 2^30 no map or width is divided; the test also keeps 2^steps out of the message, which cannot
        # print an integer of more than 4300 digits (a compression of 1e9 was a ValueError)
        if steps and (steps > 30 or any(int(value) % 2 ** steps for value in (filters, rows, cols))):
            factor = f"2^{steps} = {2 ** steps}" if steps <= 30 else f"2^{steps}"
            return (f"level {level} gets {steps} halving steps, which needs {factor} to divide its "
                    f"{filters} channels and both sides of its {rows} x {cols} map")
    return None


def check_backbone_compression(args: Mapping, source: str, rows: int, cols: int) -> None:
    """AttFuse's base_bev_backbone.compression on a (rows, cols) backbone input: every auto-encoder must give back
    its level's map, so 2^steps divides the level's channels and sides (upstream builds any value and then fails
    in the forward pass, or allocates a 2^32-fold upsampled map at compression 32)."""
    refuse_compression(args, source, COMPRESSION, f"AttFuse compresses in its backbone: use {BACKBONE_COMPRESSION}")
    layers = _setting(args, BACKBONE_COMPRESSION, source)
    bev = args["base_bev_backbone"]
    sizes = level_map_sizes(bev, rows, cols)
    problem = _steps_fit(bev, sizes, layers) if layers else None
    if problem:
        most = max(n for n in range(min(layers, 32)) if _steps_fit(bev, sizes, n) is None)  # none fits past 30
        refuse(source, f"{BACKBONE_COMPRESSION} ({layers}) does not fit the backbone: {problem}; use at most "
                       f"{most} (0: off), or change lidar_range / voxel_size or num_filters")


# ------------------------------------------------------------------------------------------ shared rules
def check_shrink_header(args: Mapping, source: str) -> int:
    """A shrink header, when there is one, has upstream's keys, one block per list entry, and takes the backbone's
    output; returns the channels of the map after it (the backbone's output when there is none)."""
    shrink = shrink_header(args)
    if shrink is None:
        return backbone_channels(args)
    for key in SHRINK_LISTS + ("input_dim",):
        if key not in shrink:
            refuse(source, f"key {SHRINK}{key} is missing (upstream's shrink_header has kernal_size, stride, "
                           f"padding and dim, one entry per block, and input_dim)")
    lists = [shrink[key] for key in SHRINK_LISTS]
    if not all(isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1 or not shrink["dim"] or \
            not all(positive_ints(shrink[key]) for key in ("kernal_size", "stride", "dim")) or \
            not _non_negative_ints(shrink["padding"]):
        refuse(source, f"{SHRINK}kernal_size, stride, padding and dim must be lists of one integer per block, of "
                       f"equal length (padding 0 or more, the others positive); got {lists}")
    if shrink["input_dim"] != backbone_channels(args):
        refuse(source, f"{SHRINK}input_dim ({shrink['input_dim']}) must equal the backbone's output channels "
                       f"({backbone_channels(args)}: sum of model.args.base_bev_backbone.num_upsample_filter)")
    return int(shrink["dim"][-1])


def check_shrink_neck(args: Mapping, source: str) -> int:
    """The rules of the neck that F-Cooper, V2X-ViT, CoBEVT, V2VNet and Where2comm share (modules/shrink_neck.py),
    in the order it is built: the shrink header, then a compression ratio that divides the shrunk map's channels.
    Returns those channels, which the model's fusion must take and its heads read."""
    channels = check_shrink_header(args, source)
    check_feature_compression(args, source)
    return channels


def check_max_cav(hypes: Mapping, source: str) -> None:
    """model.args.max_cav sizes the model's CAV slots; the dataset pads every sample to train_params.max_cav."""
    data = get_key(hypes, "train_params.max_cav", DEFAULT_MAX_CAV)
    model = hypes["model"]["args"]["max_cav"]
    if model != data:
        default = "" if get_key(hypes, "train_params.max_cav") is not None else ", the default"
        refuse(source, f"{ARGS}max_cav ({model}) must equal train_params.max_cav ({data}{default}: the most CAVs "
                       f"the dataset gives a sample)")


def check_grid_agreement(hypes: Mapping, source: str) -> None:
    """The model's copies of the data's grid and the anchors' count equal the keys the data and the anchors are
    made from. Upstream's files keep them equal by YAML anchors, which a --set of one of them splits: the pillars'
    offsets would be computed on another grid, or the heads' map would not fit the anchors."""
    args = hypes["model"]["args"]
    for key in ("voxel_size", "lidar_range"):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in args[key]):
            refuse(source, f"{ARGS}{key} must be a list of numbers, got {args[key]!r}")
    # The anchors are laid over their own copy of the range on the features' cells: another range shifts every
    # anchor off its cell, silently (90 configs here, upstream's and the forks' keep the two equal).
    for key, other in ((ARGS + "voxel_size", "preprocess.args.voxel_size"),
                       (ARGS + "lidar_range", "preprocess.cav_lidar_range"),
                       ("postprocess.anchor_args.cav_lidar_range", "preprocess.cav_lidar_range")):
        ours, theirs = get_key(hypes, key), get_key(hypes, other)
        if ours is not None and theirs is not None and [float(v) for v in ours] != [float(v) for v in theirs]:
            refuse(source, f"{key} {ours!r} differs from {other} {theirs!r}; make them equal")
    for key in (ARGS + "anchor_num", "postprocess.anchor_args.num"):
        value = get_key(hypes, key)
        if value is not None and value != args["anchor_number"]:
            refuse(source, f"{key} ({value}) differs from {ARGS}anchor_number ({args['anchor_number']}); make them "
                           f"equal")


def check_anchor_stride(hypes: Mapping, source: str, stride: Optional[float]) -> None:
    """The anchors are laid on the grid of the heads' map: their feature_stride is that map's stride, and the
    canvas comes through the backbone at the anchors' size (``check_canvas_fits``)."""
    anchors = get_key(hypes, "postprocess.anchor_args.feature_stride")
    if anchors is not None and stride is not None and anchors != stride:
        refuse(source, f"postprocess.anchor_args.feature_stride ({anchors}) must equal the stride of the heads' "
                       f"map ({stride:g}: layer_strides[0] / upsample_strides[0] x the shrink_header strides)")
    check_canvas_fits(hypes, source, stride)


def check_canvas_fits(hypes: Mapping, source: str, stride: Optional[float]) -> None:
    """The canvas (point_pillar_scatter.grid_size: the range's voxels) passes the BEV backbone and meets the
    anchors: the levels, each upsampled, come out at one size (they are concatenated), and the heads' map is the
    anchors' grid (postprocess.anchor_args H and W over feature_stride). A range that is not a whole multiple of
    the backbone's strides in voxels failed inside torch.cat or the loss, with a traceback; upstream too."""
    args = hypes["model"]["args"]
    grid, bev = get_key(args, "point_pillar_scatter.grid_size"), args.get("base_bev_backbone")
    if grid is None or not isinstance(bev, Mapping):
        return
    cols, rows = int(grid[0]), int(grid[1])
    canvas = f"the canvas is {cols} x {rows} voxels (preprocess.cav_lidar_range over preprocess.args.voxel_size)"
    fix = f"make the range's x and y extents whole multiples of {math.prod(map(int, bev['layer_strides']))} voxels"
    check_levels_concatenate(bev, rows, cols, source, canvas, fix)
    fs = get_key(hypes, "postprocess.anchor_args.feature_stride")
    width, height = get_key(hypes, "postprocess.anchor_args.W"), get_key(hypes, "postprocess.anchor_args.H")
    if stride is None or fs is None or width is None or height is None:
        return
    heads = shrunk_map_size(args)
    anchors = (int(height) // int(fs), int(width) // int(fs))
    if heads != anchors:
        refuse(source, f"{canvas}; the heads' map comes out at {heads[0]} x {heads[1]} cells and the anchors' grid "
                       f"(postprocess.anchor_args H x W {height} x {width} over feature_stride {fs}) at "
                       f"{anchors[0]} x {anchors[1]}; {fix}")


def check_levels_concatenate(bev: Mapping, rows: int, cols: int, source: str, canvas: str, fix: str) -> None:
    """The backbone's levels, each upsampled by its deblock, come out at one size from a (rows, cols) input:
    they are concatenated. ``canvas`` says where the input's size comes from, ``fix`` what to change."""
    ups = list(bev.get("upsample_strides") or [])
    if not ups:
        return
    levels = level_map_sizes(bev, rows, cols)
    upsampled = [(deblock_cells(r, up), deblock_cells(c, up)) for (r, c), up in zip(levels, ups)]
    if len(set(upsampled)) > 1:
        refuse(source, f"{canvas}; {ARGS}base_bev_backbone's levels come out at {levels} (rows, columns), "
                       f"upsampled to {upsampled}, which cannot be concatenated; {fix}")


def check_windows_divide(source: str, key: str, windows: Sequence[int], rows: float, cols: float, how: str) -> None:
    """Each window size of ``key`` divides both sides of the fused map (``rows`` x ``cols``, made as ``how`` says):
    the windowed attentions of CoBEVT and V2X-ViT tile the map exactly."""
    bad = [w for w in windows if rows != int(rows) or cols != int(cols) or int(rows) % w or int(cols) % w]
    if bad:
        refuse(source, f"{key} {list(windows) if len(windows) > 1 else windows[0]} must divide both sides of the "
                       f"fused BEV map ({rows:g} rows x {cols:g} columns: {how}); {bad} do not: change the window "
                       f"size or lidar_range")


__all__ = ["refuse", "check_windows_divide", "positive_ints", "check_bev_backbone", "backbone_channels",
           "shrink_header", "head_channels", "head_stride", "check_shrink_header", "check_shrink_neck",
           "check_max_cav", "check_grid_agreement", "check_anchor_stride", "check_canvas_fits", "level_map_sizes",
           "deblock_cells", "shrunk_map_size", "backbone_compression_steps", "refuse_compression",
           "check_feature_compression", "check_backbone_compression", "DEFAULT_MAX_CAV", "ARGS", "SHRINK",
           "SHRINK_LISTS", "SHRINK_HEADER_KEYS", "COMPRESSION", "BACKBONE_COMPRESSION"]
