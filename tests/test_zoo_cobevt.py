"""CoBEVT (point_pillar_cobevt): the swap-fusion windows and mask, per-sample fusion and its hypes keys (the zoo's
shared contracts run in tests/test_zoo_contracts.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoo
from launch import REPO, torch_threads
from opencood_ddp.models import create_model
from opencood_ddp.models.modules.biased_attention import biased_attention
from opencood_ddp.models.modules.swap_fusion import (SwapFusionBlockMask, TokenOrders, WindowAttention,
                                                     cells_from_tokens, relative_position_index, window_tokens)
from opencood_ddp.models.point_pillar_cobevt import to_slots

CORE = "point_pillar_cobevt"
OPV2V = REPO / "hypes_yaml" / "opv2v" / f"{CORE}.yaml"
TOY = REPO / "hypes_yaml" / "toy" / f"{CORE}.yaml"
UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes" / f"{CORE}.yaml"
FAX = "model.args.fax_fusion"


@pytest.fixture(scope="module")
def toy(toy_small):
    """(task, samples): the toy config's task and the first four training samples, read once."""
    return zoo.toy_samples(TOY, toy_small)


batch_of = zoo.ego_batch


def toy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(zoo.hypes_of(TOY)).eval()


def keep_first_cav(ego: dict) -> dict:
    """The batch with each sample reduced to its ego (record_len all ones)."""
    lidar, record_len = ego["processed_lidar"], ego["record_len"]
    egos = torch.cumsum(record_len, 0) - record_len
    keep = torch.isin(lidar["voxel_coords"][:, 0], egos.to(lidar["voxel_coords"].dtype))
    coords = lidar["voxel_coords"][keep].clone()
    coords[:, 0] = torch.searchsorted(egos.to(coords.dtype), coords[:, 0].contiguous())
    return dict(ego, record_len=torch.ones_like(record_len), processed_lidar={
        "voxel_features": lidar["voxel_features"][keep], "voxel_coords": coords,
        "voxel_num_points": lidar["voxel_num_points"][keep]})


# ------------------------------------------------------------------------------------------ the fusion parts
@pytest.mark.parametrize("dilated", [False, True])
def test_windows_round_trip(dilated):
    cells = torch.randn(2, 3, 6, 10, 4)
    assert torch.equal(cells_from_tokens(window_tokens(cells, 2, dilated), cells.shape, 2, dilated), cells)


def test_token_orders_move_rows_as_the_window_gathers_do_and_back():
    cells = torch.randn(2, 3, 6, 10, 4, dtype=torch.float64, requires_grad=True)
    orders = TokenOrders(cells.shape, 2, cells.device)
    rows = cells.reshape(-1, 4)
    local = orders.move(rows, "cells", "local")
    grid = orders.move(local, "local", "grid")
    assert torch.equal(local, window_tokens(cells, 2, False).reshape(-1, 4))
    assert torch.equal(grid, window_tokens(cells, 2, True).reshape(-1, 4))
    assert torch.equal(orders.move(grid, "grid", "local"), local)
    assert torch.equal(orders.move(grid, "grid", "cells"), rows)
    # The backward is the inverse gather: the gradient the window gathers' own backward gives, for one move and
    # for two.
    weight = torch.randn_like(grid)
    for moved, plain in ((local, window_tokens(cells, 2, False)),
                         (grid, window_tokens(cells_from_tokens(window_tokens(cells, 2, False), cells.shape, 2, False),
                                              2, True))):
        ours = torch.autograd.grad((moved * weight).sum(), cells, retain_graph=True)[0]
        assert torch.equal(ours, torch.autograd.grad((plain.reshape(-1, 4) * weight).sum(), cells)[0])


def test_local_windows_are_neighbours_and_grid_windows_span_the_map():
    cells = torch.randn(1, 2, 6, 10, 4)  # (B, L, H, W, C): 3 x 5 windows of 2 x 2
    local, grid = window_tokens(cells, 2, False), window_tokens(cells, 2, True)  # (X Y, L w w, C)
    window, token = 1 * 5 + 2, 1 * 4 + 1 * 2 + 0  # window (1, 2); agent 1, cell (1, 0)
    assert torch.equal(local[window, token], cells[0, 1, 1 * 2 + 1, 2 * 2 + 0])
    assert torch.equal(grid[window, token], cells[0, 1, 1 * 3 + 1, 0 * 5 + 2])  # rows 3 apart, columns 5


def test_relative_position_index_covers_the_table():
    index = relative_position_index(5, 4)
    assert index.shape == (80, 80) and index.min() == 0 and index.max() == 9 * 7 * 7 - 1
    assert int(index.unique().numel()) == 9 * 7 * 7  # every bias is used: no unused DDP parameter
    assert torch.equal(index.diagonal(), torch.full((80,), (9 * 7 * 7) // 2))  # offset 0 is the centre


def test_absent_slots_do_not_reach_present_ones():
    torch.manual_seed(0)
    block = SwapFusionBlockMask(8, 16, 4, 2, 3, 0.0).eval()
    x = torch.randn(2, 3, 4, 6, 8)  # (B, L, H, W, C)
    present = torch.tensor([[True, True, False], [True, False, False]])
    changed = x.clone()
    changed[0, 2], changed[1, 1:] = 5.0, -3.0
    with torch.no_grad():
        a, b = block(x, present), block(changed, present)
    assert torch.allclose(a[0, :2], b[0, :2], atol=1e-6) and torch.allclose(a[1, :1], b[1, :1], atol=1e-6)


def plain_block(block: SwapFusionBlockMask, cells: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """The block as CoBEVT states it, one window at a time: the window's cells gathered by their row and column,
    each head's softmax of q k^T / sqrt(d) + the relative bias with absent agents' keys at -inf, the output and
    feed-forward residuals, the cells written back; local windows first, then grid windows."""
    b, agents, height, width, dim = cells.shape
    w = block.window_size
    nx, ny = height // w, width // w
    for dilated, attention, ffd in ((False, block.window_attention, block.window_ffd),
                                    (True, block.grid_attention, block.grid_ffd)):
        att, out = attention.fn, cells.clone()
        for s, x, y in ((s, x, y) for s in range(b) for x in range(nx) for y in range(ny)):
            rows = [i * nx + x if dilated else x * w + i for i in range(w)]
            cols = [j * ny + y if dilated else y * w + j for j in range(w)]
            index = [(a, r, c) for a in range(agents) for r in rows for c in cols]
            tokens = torch.stack([cells[s, a, r, c] for a, r, c in index])
            keys = torch.tensor([bool(present[s, a]) for a, _, _ in index])
            q, k, v = att.to_qkv(attention.norm(tokens)).chunk(3, dim=-1)
            heads = []
            for h, part in enumerate(range(0, dim, dim // att.heads)):
                cut = slice(part, part + dim // att.heads)
                logits = q[:, cut] @ k[:, cut].T * att.scale
                logits = logits + att.relative_position_bias_table.weight[att.relative_position_index, h]
                heads.append(logits.masked_fill(~keys, float("-inf")).softmax(dim=-1) @ v[:, cut])
            tokens = att.to_out(torch.cat(heads, dim=-1)) + tokens
            tokens = ffd.fn(ffd.norm(tokens)) + tokens
            for t, (a, r, c) in enumerate(index):
                out[s, a, r, c] = tokens[t]
        cells = out
    return cells


def random_bias_block(drop_out: float = 0.0) -> SwapFusionBlockMask:
    """A float64 block (dim 8, 2 heads, 2 x 2 windows, 3 agents) with a random relative bias."""
    torch.manual_seed(0)
    block = SwapFusionBlockMask(8, 16, 4, 2, 3, drop_out).double()
    with torch.no_grad():
        block.window_attention.fn.relative_position_bias_table.weight.normal_()
        block.grid_attention.fn.relative_position_bias_table.weight.normal_()
    return block


def test_the_block_equals_one_window_at_a_time_in_float64():
    block = random_bias_block().eval()
    cells = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64)
    present = torch.tensor([[True, True, False], [True, False, False]])
    with torch.no_grad():
        assert torch.allclose(block(cells, present), plain_block(block, cells, present), rtol=0, atol=1e-12)


def test_the_blocks_gradients_equal_one_window_at_a_time_in_float64():
    """Training mode: the head-at-a-time attention's backward against autograd through the plain reading."""
    block = random_bias_block().train()
    cells = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    present = torch.tensor([[True, True, False], [True, False, False]])
    grad = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64)
    leaves = [cells, *block.parameters()]
    ours = torch.autograd.grad(block(cells, present), leaves, grad)
    plain = torch.autograd.grad(plain_block(block, cells, present), leaves, grad)
    for name, a, b in zip(["cells"] + [n for n, _ in block.named_parameters()], ours, plain):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


def test_in_place_dropout_changes_no_value_or_gradient_of_the_block():
    """The block's dropouts write over their inputs (flat rows, not views); the same block with them out of place
    gives the same bits, forward and backward."""
    block = random_bias_block(drop_out=0.3).train()
    apart = copy.deepcopy(block)
    for layer in apart.modules():
        if isinstance(layer, nn.Dropout):
            layer.inplace = False
    cells = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    present = torch.tensor([[True, True, False], [True, False, False]])
    results = []
    for model in (block, apart):
        torch.manual_seed(5)
        out = model(cells, present)
        results.append((out, torch.autograd.grad(out.square().sum(), [cells, *model.parameters()])))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """torch's thread count for a test: torch splits the batched products over its threads on two."""
    with torch_threads(request.param):
        yield request.param


def test_head_loop_attention_equals_the_plain_reading_and_passes_gradcheck(threads):
    torch.manual_seed(1)
    attention = WindowAttention(16, 4, 0.0, 3, 2).double()
    present = torch.tensor([[True, True, False], [True, False, False]])
    # 2 samples x 6 windows of 12 tokens, 4 heads of 4: products large enough for torch's gemm path
    qkv = torch.randn(2 * 6, 12, 48, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, 12, 12, dtype=torch.float64, requires_grad=True)
    key_bias = attention.key_bias(present, 12, torch.float64)
    ours = biased_attention(qkv, bias, key_bias, attention.heads, attention.scale)
    plain = attention.plain_attention(qkv, bias, present)
    assert torch.allclose(ours, plain, rtol=0, atol=1e-13)
    grad = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (qkv, bias), grad), torch.autograd.grad(plain, (qkv, bias), grad)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    small = torch.randn(4, 6, 12, dtype=torch.float64, requires_grad=True)  # 2 samples x 2 windows, 2 heads
    table = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    keys = torch.tensor([[0.0] * 6, [0.0] * 3 + [torch.finfo(torch.float64).min] * 3], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, b: biased_attention(q, b, keys, 2, 0.4), (small, table))


def test_head_loop_attention_without_gradients_gives_the_same_bits():
    """Under no_grad it keeps one head's probabilities instead of every head's; the output is the same."""
    torch.manual_seed(2)
    qkv, bias = torch.randn(6, 12, 48, requires_grad=True), torch.randn(4, 12, 12, requires_grad=True)
    key_bias = torch.zeros(2, 12)
    key_bias[1, 8:] = torch.finfo(torch.float32).min
    training = biased_attention(qkv, bias, key_bias, 4, 0.5)
    with torch.no_grad():
        assert torch.equal(biased_attention(qkv, bias, key_bias, 4, 0.5), training)


def test_head_loop_attention_refuses_a_key_bias_that_takes_gradients():
    qkv = torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match="key_bias"):
        biased_attention(qkv, torch.zeros(2, 4, 4), torch.zeros(1, 4, requires_grad=True), 2, 1.0)


def test_to_slots_pads_and_masks():
    x = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 2, 2)
    slots, present = to_slots(x, torch.tensor([2, 1]), 3)
    assert present.tolist() == [[True, True, False], [True, False, False]]
    assert slots[0, 1, 0, 0, 0] == 1 and slots[1, 0, 0, 0, 0] == 2 and slots[0, 2].abs().sum() == 0
    with pytest.raises(ValueError, match="max_cav"):
        to_slots(x, torch.tensor([3]), 2)


# ------------------------------------------------------------------------------------------ the model
def test_forward_backward_gives_one_map_per_sample(toy_small):
    out = zoo.assert_forward_backward(TOY, toy_small)
    assert out["psm"].shape == (2, 2, 30, 60) and out["rm"].shape == (2, 14, 30, 60)  # stride 4 on 240 x 120


def test_a_samples_output_depends_only_on_its_own_cavs(toy):
    model = toy_model()
    with torch.no_grad():
        alone, together = model(batch_of(toy, 0)), model(batch_of(toy, 0, 1))
    assert torch.allclose(alone["psm"][0], together["psm"][0], atol=1e-5)
    assert torch.allclose(alone["rm"][0], together["rm"][0], atol=1e-5)


def test_single_cav_samples_work(toy):
    ego = batch_of(toy, 0, 1)
    assert int(ego["record_len"].max()) > 1, "the toy samples should have several CAVs"
    with torch.no_grad():
        out = toy_model()(keep_first_cav(ego))
    assert out["psm"].shape == (2, 2, 30, 60) and torch.isfinite(out["rm"]).all()


# ------------------------------------------------------------------------------------------ hypes keys
@pytest.mark.parametrize("override,key", [
    (f"{FAX}.window_size=7", f"{FAX}.window_size"),  # 7 divides neither 30 nor 60
    (f"{FAX}.window_size=0", f"{FAX}.window_size"),
    (f"{FAX}.agent_size=4", f"{FAX}.agent_size"),
    (f"{FAX}.input_dim=32", f"{FAX}.input_dim"),
    (f"{FAX}.mlp_dim=0", f"{FAX}.mlp_dim"),
    (f"{FAX}.dim_head=24", f"{FAX}.dim_head"),
    (f"{FAX}.drop_out=1.5", f"{FAX}.drop_out"),
    (f"{FAX}.drop_out=high", f"{FAX}.drop_out"),
    (f"{FAX}.depth=0", f"{FAX}.depth"),
    (f"{FAX}.mask=false", f"{FAX}.mask"),
    ("model.args.max_cav=4", "model.args.max_cav"),
    ("model.args.shrink_header.input_dim=100", "model.args.shrink_header.input_dim"),
])
def test_wrong_values_name_their_key(override, key):
    zoo.assert_key_error(TOY, override, key)


def test_v2v4reals_point_pillar_fax_is_this_model_under_the_forks_name():
    """The V2V4Real fork's point_pillar_fax.py is upstream's CoBEVT class renamed: its hypes files and its runs'
    config.yaml name it so. The name builds the same class and state dict, so the fork's checkpoints load strictly."""
    config = REPO / "hypes_yaml" / "v2v4real" / "point_pillar_cobevt.yaml"
    ours = create_model(zoo.hypes_of(config))
    forks = create_model(zoo.hypes_of(config, "model.core_method=point_pillar_fax"))
    assert type(forks) is type(ours)
    assert [(k, v.shape) for k, v in forks.state_dict().items()] == [(k, v.shape) for k, v in ours.state_dict().items()]
    forks.load_state_dict(ours.state_dict(), strict=True)
