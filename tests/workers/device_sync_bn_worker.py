"""torchrun worker: distributed/device_sync_bn.py's synchronized batch norm against torch's SyncBatchNorm function
and against one float64 BatchNorm over the global batch, on gloo ranks over the CPU stand-ins of the CUDA kernels
(tests/cuda_bn_kernels.py).

Usage: torchrun --nproc_per_node=W device_sync_bn_worker.py --counts 3,0,5 [6,4,0 ...] --out result.json
           [--device cuda]

With ``--device cuda`` the ranks share the machine's GPUs over gloo (OPENCOOD_DDP_SHARE_GPUS=1 where there are fewer
GPUs than ranks) and both sides run CUDA's own kernels; on the CPU, the stand-ins.

For each set of counts (one launch proves them all), every rank holds `counts[rank]` samples (0: an empty input,
as a rank whose batch has no pillar), and each side runs ITERATIONS training forwards and backwards from the same
state. Rank 0 writes, per set of counts, over the ranks and iterations:
- ``equal_to_torch``: whether outputs, input and parameter gradients and running statistics equal those of
  torch's ``SyncBatchNorm`` function bit for bit (gradients on the ranks with values: torch gives an empty rank
  None);
- ``gap_to_torch``: the largest relative difference from torch's, where not equal;
- ``gap_to_float64``: the largest relative difference from the float64 BatchNorm over the global batch;
- ``host_reads``: on each side, the ops that read the device back (nonzero, _local_scalar_dense, item,
  masked_select, and indexing with a boolean mask), over all forwards and backwards;
- ``compiled_equal`` (on the CPU; None with ``--device cuda``): whether our layer compiled as ``--capture`` compiles
  the dense step on N GPUs, in one graph (``fullgraph=True``: a graph break raises) with its collectives traced into
  it and inductor's partition of forward and backward, gives our eager layer's outputs, gradients and running
  statistics bit for bit (the graphs run on the eager kernels, as ``aot_eager``). On the GPU the ranks share the
  device over gloo, which no compiled run uses;
- ``declared_writes`` (the same): whether every compiled forward graph writes the running statistics through the
  combine whose writes are declared (``auto_functionalized``), which inductor keeps; torch's kernel updates them
  unseen, and on a rank with an empty input inductor dropped it.
"""
import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuda_bn_kernels  # noqa: E402

from opencood_ddp.distributed import comm  # noqa: E402
from opencood_ddp.distributed.device_sync_bn import DeviceSyncBatchNorm  # noqa: E402
from opencood_ddp.distributed.env import detect_from_process, distributed_session  # noqa: E402

CHANNELS, ITERATIONS, MOMENTUM, EPS = 5, 3, 0.1, 1e-5
HOST_READS = ("aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::masked_select")


def _bool_index(func, args) -> bool:
    """aten::index with a boolean mask: the kernel calls nonzero below the dispatcher's Python key."""
    return func._schema.name == "aten::index" and len(args) > 1 and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


class HostReads(TorchDispatchMode):
    """Counts the ops that read the device back on CUDA: the ones named, and boolean-mask indexing."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_READS:
            self.calls[name] += 1
        elif _bool_index(func, args):
            self.calls["aten::index (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


class TorchSide(nn.Module):
    """torch's SyncBatchNorm function with the module's state, as nn.SyncBatchNorm calls it on CUDA."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        bn = self.layer
        bn.num_batches_tracked.add_(1)
        return TorchSyncBatchNormFunction.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                                                MOMENTUM, dist.group.WORLD, dist.get_world_size())


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        cuda_bn_kernels.register()
    env = detect_from_process(backend="gloo")
    device = torch.device(env.device if args.device == "cuda" else "cpu")
    with distributed_session(env):
        reports = {spec: run_counts([int(c) for c in spec.split(",")], env.rank, device) for spec in args.counts}
        if env.rank == 0:
            Path(args.out).write_text(json.dumps(reports))


def recording_backend(forward_graphs: list):
    """torch.compile's backend: AOTAutograd with inductor's partition of forward and backward (a collective that
    depends on constants only may move to the forward), the graphs run by torch's eager kernels, the forward graphs
    kept in `forward_graphs`."""
    def forward_compiler(graph_module, example_inputs):
        forward_graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        partition_fn=min_cut_rematerialization_partition)


def declares_its_writes(graph_module) -> bool:
    return any(node.op == "call_function" and "auto_functionalized" in str(node.target)
               and "opencood_ddp.batch_norm_gather_stats_with_counts" in str(node.args[0])
               for node in graph_module.graph.nodes)


def layers(device: torch.device) -> tuple:
    """The float64 reference and the three float32 layers (ours, torch's, ours to compile), all from the same
    state."""
    gen = torch.Generator().manual_seed(7)
    reference = nn.BatchNorm2d(CHANNELS, eps=EPS, momentum=MOMENTUM).double()
    with torch.no_grad():
        reference.weight.copy_(torch.rand(CHANNELS, generator=gen) + 0.5)
        reference.bias.copy_(torch.randn(CHANNELS, generator=gen))
    ours, traced = (DeviceSyncBatchNorm(CHANNELS, eps=EPS, momentum=MOMENTUM) for _ in range(2))
    theirs = nn.SyncBatchNorm(CHANNELS, eps=EPS, momentum=MOMENTUM)
    for layer in (ours, theirs, traced):
        layer.load_state_dict({k: v.to(torch.int64 if k.endswith("tracked") else torch.float32)
                               for k, v in reference.state_dict().items()})
    return reference.to(device), ours.to(device), TorchSide(theirs).to(device), traced.to(device)


def step(side, layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor, reads: Optional[Counter]) -> dict:
    """One training forward and backward of a float32 side on this rank's rows; what it gives. `reads` (None: not
    counted) gets the host reads."""
    local = x.detach().float().requires_grad_(True)
    layer.weight.grad = layer.bias.grad = None
    with HostReads() if reads is not None else contextlib.nullcontext() as mode:
        out = side(local)
        out.backward(upstream.float())
    if reads is not None:
        reads.update(mode.calls)
    grads = torch.cat([g if g is not None else torch.zeros_like(layer.weight)
                       for g in (layer.weight.grad, layer.bias.grad)])
    return {"output": out.detach(), "input_grad": local.grad, "param_grad": grads,
            "running_mean": layer.running_mean.clone(), "running_var": layer.running_var.clone()}


def run_counts(counts: list, rank: int, device: torch.device) -> dict:
    """This set of counts on each side (and, on the CPU, compiled); the report on rank 0 (None on the others)."""
    reference, ours, theirs, traced = layers(device)
    forward_graphs: list = []
    compiled = torch.compile(traced, backend=recording_backend(forward_graphs), fullgraph=True, dynamic=False) \
        if device.type == "cpu" else None
    gen = torch.Generator().manual_seed(11)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
    equal, gap_torch, gap_f64 = True, 0.0, 0.0
    compiled_equal = None if compiled is None else True
    reads = {"ours": Counter(), "torch": Counter()}
    for _ in range(ITERATIONS):
        x = (torch.randn(sum(counts), CHANNELS, 3, 4, generator=gen) * 2 + 5).double().to(device).requires_grad_()
        upstream = torch.randn(x.shape, generator=gen).double().to(device)
        out_ref = reference(x)
        out_ref.backward(upstream)
        mine = step(ours, ours, x[start:stop], upstream[start:stop], reads["ours"])
        torchs = step(theirs, theirs.layer, x[start:stop], upstream[start:stop], reads["torch"])
        if compiled is not None:
            graphs = step(compiled, traced, x[start:stop], upstream[start:stop], None)
            compiled_equal = compiled_equal and all(torch.equal(graphs[key], mine[key]) for key in mine)
        for key in mine:
            if key in ("input_grad", "param_grad") and stop == start:
                continue  # torch leaves an empty rank's gradients None; ours are zeros
            if not torch.equal(mine[key], torchs[key]):
                equal, gap_torch = False, max(gap_torch, relative_gap(mine[key], torchs[key]))
        summed = mine["param_grad"].clone()
        dist.all_reduce(summed)  # DDP averages; the sum over ranks is the global batch's gradient
        exact = {"output": out_ref.detach()[start:stop], "input_grad": x.grad[start:stop],
                 "param_grad": torch.cat([reference.weight.grad, reference.bias.grad]),
                 "running_mean": reference.running_mean, "running_var": reference.running_var}
        gap_f64 = max([gap_f64] + [relative_gap(summed if key == "param_grad" else mine[key], value)
                                   for key, value in exact.items()])
        reference.zero_grad()
        x.grad = None
    flags = comm.all_gather_objects({"equal": equal, "gap_torch": gap_torch, "gap_f64": gap_f64,
                                     "compiled_equal": compiled_equal,
                                     "declared_writes": bool(forward_graphs) and all(map(declares_its_writes,
                                                                                         forward_graphs)),
                                     "reads": {k: dict(v) for k, v in reads.items()},
                                     "finite": bool(torch.isfinite(torch.cat([mine["running_mean"],
                                                                              mine["running_var"]])).all())})
    if rank != 0:
        return None
    return {"equal_to_torch": all(f["equal"] for f in flags), "gap_to_torch": max(f["gap_torch"] for f in flags),
            "gap_to_float64": max(f["gap_f64"] for f in flags), "finite": all(f["finite"] for f in flags),
            "compiled_equal": None if compiled is None else all(f["compiled_equal"] for f in flags),
            "declared_writes": None if compiled is None else all(f["declared_writes"] for f in flags),
            "host_reads": [f["reads"] for f in flags]}


if __name__ == "__main__":
    main()
