"""What every model of the zoo must show, as functions; tests/test_zoo_contracts.py runs them for each of `MODELS`,
and a model's own test file calls the ones it needs with other arguments.

- `hypes_of`: a hypes file read the way training reads it, optionally pointed at a toy world (every test's path).
- `assert_reference_state_dict`: state_dict keys, order and shapes of the opv2v config equal upstream's reference.
- `assert_upstream_checkpoint_loads`: a state dict with upstream's keys and shapes loads strictly.
- `assert_forward_backward`: the toy config's model gives psm/rm of the anchors' shape on a real toy batch, and
  every parameter gets a finite gradient.
- `assert_key_error`: a wrong value of a key gives one ConfigError naming it.
- `assert_batch_independent`: in eval mode a sample's outputs do not depend on its batch's other samples or order.
- `assert_state_dict_round_trips`: a saved state dict loads strictly into a fresh model, same tensors and outputs.

What the engine guarantees (2 ranks follow 1, exact resume, distributed evaluation equal to 1 process) is proven on
real torchrun processes once per engine path (tests/test_end_to_end.py, test_opencood_training.py,
test_resilience.py); for every zoo model one real 2-rank DDP step is taken in one shared launch
(tests/workers/zoo_ddp_step_worker.py, from test_zoo_contracts.py).
"""
from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch

from launch import REPO, toy_overrides

REFERENCE = REPO / "tests" / "reference" / "opencood_state_dict"
UPSTREAM_HYPES = REPO / "tests" / "reference" / "upstream_hypes"

# The zoo's models: core_method -> the stem of their hypes files (hypes_yaml/{opv2v,toy}/ and upstream's).
MODELS = {
    "point_pillar_cobevt": "point_pillar_cobevt",
    "point_pillar_transformer": "point_pillar_v2xvit",
    "point_pillar_v2vnet": "point_pillar_v2vnet",
    "point_pillar_where2comm": "point_pillar_where2comm",
    "second_intermediate": "second_intermediate_fusion",
}


def hypes_of(config: Path | str, *overrides: str, toy_root: Path | None = None, layout: str = "opv2v",
             **sections: object) -> dict:
    """The hypes of `config` read as training, evaluation and the tools read them: `yaml_parsers.load_parsed_hypes`
    (the --set overrides applied, the keys a run wrote about itself dropped, `imports:` imported, the `yaml_parser`
    run, the engine's keys validated). The tests read hypes here; `load_hypes` alone only where a test is about the
    file as written.

    config: a path, or a file under hypes_yaml/ named without `.yaml` ("toy/point_pillar_early_fusion").
    toy_root: a toy world the config reads (`launch.toy_overrides(toy_root, layout)`), set before `overrides`.
    sections: top-level sections given whole (`wild_setting={...}`), set last as `--set key=value` sets them (the
    value written in YAML by the writer of config.yaml, so a NaN stays a float)."""
    import yaml

    from opencood_ddp.hypes import HypesDumper
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    path = REPO / "hypes_yaml" / f"{config}.yaml" if isinstance(config, str) else config
    world = toy_overrides(toy_root, layout) if toy_root is not None else []
    whole = [f"{key}={yaml.dump(value, Dumper=HypesDumper, default_flow_style=True, sort_keys=False, width=math.inf)}"
             for key, value in sections.items()]
    return load_parsed_hypes(path, [*world, *overrides, *whole])


def reference_shapes(core_method: str) -> list[tuple[str, list[int]]]:
    rows = (REFERENCE / f"{core_method}.tsv").read_text().splitlines()
    return [(name, ast.literal_eval(shape)) for name, shape in (row.split("\t") for row in rows)]


# The V2X-ViT repository's and the V2V4Real fork's point_pillar (read from their models/point_pillar.py): OpenCOOD's
# layers, then DownsampleConv(shrink_header) as shrink_conv (3x3 stride 2, 384 -> 256), then heads of cls_head_dim
# 256 channels.
FORK_SHRINK_ROWS = [("shrink_conv.layers.0.double_conv.0.weight", [256, 384, 3, 3]),
                    ("shrink_conv.layers.0.double_conv.0.bias", [256]),
                    ("shrink_conv.layers.0.double_conv.2.weight", [256, 256, 3, 3]),
                    ("shrink_conv.layers.0.double_conv.2.bias", [256])]


def fork_point_pillar_shapes() -> list[tuple[str, list[int]]]:
    """The forks' point_pillar state dict (names, order, shapes), derived from OpenCOOD's list."""
    heads = {"cls_head.weight": [2, 256, 1, 1], "reg_head.weight": [14, 256, 1, 1]}
    rows = [(name, heads.get(name, shape)) for name, shape in reference_shapes("point_pillar")]
    at = [name for name, _ in rows].index("cls_head.weight")
    return rows[:at] + FORK_SHRINK_ROWS + rows[at:]


def assert_reference_state_dict(config: Path, core_method: str) -> None:
    from opencood_ddp.models import create_model

    hypes = hypes_of(config)
    assert hypes["model"]["core_method"] == core_method
    ours = [(name, list(tensor.shape)) for name, tensor in create_model(hypes).state_dict().items()]
    theirs = reference_shapes(core_method)
    missing = [n for n, _ in theirs if n not in dict(ours)]
    extra = [n for n, _ in ours if n not in dict(theirs)]
    assert not missing and not extra, f"missing {missing[:8]}, unexpected {extra[:8]}"
    assert ours == theirs  # names, shapes and order


def assert_upstream_checkpoint_loads(config: Path, core_method: str) -> None:
    from opencood_ddp.checkpoint_files import load_weights
    from opencood_ddp.models import create_model

    model = create_model(hypes_of(config))
    generator = torch.Generator().manual_seed(0)
    upstream = {name: (torch.randint(0, 5, shape, generator=generator) if name.endswith("num_batches_tracked")
                       else torch.randn(shape, generator=generator))
                for name, shape in reference_shapes(core_method)}
    load_weights(model, upstream, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, upstream[name].to(value.dtype)), name


def toy_batch(config: Path, toy_root: Path, samples: int = 2, *overrides: str) -> tuple[dict, torch.nn.Module,
                                                                                         object]:
    """(collated training batch of the first `samples` frames, model, task) of a toy config."""
    from opencood_ddp.tasks import build_task

    hypes = hypes_of(config, *overrides, toy_root=toy_root)
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[i] for i in range(samples)])
    return batch, task.model, task


def toy_samples(config: Path, toy_root: Path, count: int = 4) -> tuple[object, list]:
    """(task, samples): a toy config's task and its first `count` training samples, for a module-scoped fixture."""
    from opencood_ddp.tasks import build_task

    hypes = hypes_of(config, toy_root=toy_root)
    task = build_task(hypes, for_training=True)
    return task, [task.train_set[i] for i in range(count)]


def ego_batch(toy: tuple[object, list], *indices: int) -> dict:
    """The collated "ego" batch of the given samples of `toy_samples`' result."""
    task, samples = toy
    return task.collate_train([samples[i] for i in indices])["ego"]


def lone_cav(sample: dict) -> dict:
    """The sample with its ego CAV only (the cooperators' voxels dropped): a fused model must take one CAV."""
    lone = copy.deepcopy(sample)
    lidar = lone["ego"]["processed_lidar"]
    for key in lidar:
        lidar[key] = lidar[key][:1]
    lone["ego"]["cav_num"] = 1
    return lone


def assert_forward_backward(config: Path, toy_root: Path) -> dict:
    """One training step's forward and backward; returns the model output for model-specific checks."""
    batch, model, task = toy_batch(config, toy_root)
    model.train()
    out = task.step(model, batch)
    assert torch.isfinite(out.total), out.total
    out.total.backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not no_grad, f"parameters without a gradient: {no_grad[:8]}"
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad[:8]}"
    assert_zero_gradients_are_the_unused_groups(model)
    model.eval()
    with torch.no_grad():
        return model(batch["ego"])


def assert_zero_gradients_are_the_unused_groups(model: torch.nn.Module) -> None:
    """After a forward and backward: the parameters whose whole gradient is zero are exactly those of the groups
    the model reports unused (models/parameter_use.py), which the engine gives grad None as upstream's graph
    leaves them out. A layer that runs on an empty input without reporting it would show up here, and Adam
    would move it where upstream does not."""
    from opencood_ddp.models.parameter_use import take_parameter_use

    unused = {id(p) for group, used in take_parameter_use(model) if not used for p in group}
    zero = {id(p) for p in model.parameters() if p.grad is not None and not p.grad.any()}
    names = {id(p): n for n, p in model.named_parameters()}
    assert zero == unused, (f"zero gradient, not reported unused: {sorted(names[i] for i in zero - unused)[:8]}; "
                            f"reported unused with a gradient: {sorted(names[i] for i in unused - zero)[:8]}")


def assert_key_error(config: Path, override: str, key: str) -> None:
    """`--set override` must give one ConfigError whose message names `key`."""
    from opencood_ddp.errors import ConfigError
    from opencood_ddp.models import create_model

    with pytest.raises(ConfigError) as caught:
        create_model(hypes_of(config, override))
    message = str(caught.value)
    assert key in message and "\n" not in message, message


def assert_batch_independent(config: Path, toy: tuple[object, list]) -> None:
    """In eval mode a sample's outputs do not depend on the other samples of its batch, nor on their order:
    samples 0 and 1 batched as [0, 1] and [1, 0] give each sample what it gives alone. (In training mode
    BatchNorm couples the samples of a batch by design.)"""
    task, samples = toy
    model = task.model.eval()
    with torch.no_grad():
        alone = [model(task.collate_train([samples[i]])["ego"]) for i in (0, 1)]
        pair = model(task.collate_train(samples[:2])["ego"])
        swapped = model(task.collate_train(samples[1::-1])["ego"])
    for key, value in alone[0].items():
        if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 1):
            continue  # not a per-sample output
        for i in (0, 1):
            want = alone[i][key][0]
            scale = float(want.abs().max()) or 1.0
            for got, where in ((pair[key][i], "[0, 1]"), (swapped[key][1 - i], "[1, 0]")):
                gap = float((got - want).abs().max()) / scale
                # float32 rounding of kernels that tile a batch of 2 otherwise than a batch of 1
                assert gap <= 1e-5, f"{config.name}: {key} of sample {i} in batch {where} differs by {gap:.2e}"


def assert_state_dict_round_trips(config: Path, toy: tuple[object, list]) -> None:
    """A state dict written with torch.save loads strictly into a model built with another seed, which then
    holds the same tensors and gives the same outputs."""
    import io

    from opencood_ddp.checkpoint_files import load_weights
    from opencood_ddp.models import create_model

    task, samples = toy
    model = task.model.eval()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    torch.manual_seed(12345)
    other = create_model(hypes_of(config)).eval()
    load_weights(other, torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), strict=True)
    mine, theirs = model.state_dict(), other.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = task.collate_train(samples[:1])["ego"]
    with torch.no_grad():
        a, b = model(batch), other(batch)
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def override_copy(hypes: dict, path: str, value: object) -> dict:
    """A deep copy of `hypes` with the dotted `path` set to `value` (for model-level checks without the CLI)."""
    out = copy.deepcopy(hypes)
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


def pairwise_moves(moves: dict, cavs: int = 2) -> torch.Tensor:
    """(1, cavs, cavs, 4, 4) pairwise_t_matrix: the identity off the diagonal except `moves` {j: 4x4 ego -> CAV
    j}, a zero diagonal (the dataset writes the identity there; zeros show that a warp never reads it)."""
    pairwise = torch.eye(4, dtype=torch.float64).repeat(1, cavs, cavs, 1, 1)
    for i in range(cavs):
        pairwise[0, i, i] = 0
    for j, matrix in moves.items():
        pairwise[0, 0, j] = matrix
    return pairwise
