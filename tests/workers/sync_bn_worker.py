"""torchrun worker: GlooSyncBatchNorm (float32) on each rank's shard vs one BatchNorm over the global batch in
float64, the exact statistics float32 must round to.

Usage: torchrun --nproc_per_node=W sync_bn_worker.py --counts 3,5 --out result.json
Rank 0 writes the largest absolute differences found (outputs, input grads, parameter grads, running stats).
"""
import argparse
import json

import torch
import torch.distributed as dist
from torch import nn

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import detect_from_process, distributed_session
from opencood_ddp.distributed.sync_bn import GlooSyncBatchNorm, convert_sync_batchnorm

CASES = {  # name: (BatchNorm class, per-sample shape after the channel dim, momentum, memory format)
    "bn2d": (nn.BatchNorm2d, (5, 7), 0.1, torch.contiguous_format),
    "bn1d_nc": (nn.BatchNorm1d, (), 0.1, torch.contiguous_format),
    "bn1d_ncl": (nn.BatchNorm1d, (9,), 0.3, torch.contiguous_format),
    "bn2d_cumulative": (nn.BatchNorm2d, (4, 4), None, torch.contiguous_format),
    # The BEV canvas' layout, with thousands of rows per rank: where float32 per-channel sums drift.
    "bn2d_channels_last": (nn.BatchNorm2d, (40, 60), 0.1, torch.channels_last),
}
CHANNELS, ITERATIONS = 6, 3


def run_case(name, counts, rank):
    bn_cls, tail, momentum, memory_format = CASES[name]
    gen = torch.Generator().manual_seed(1234)
    reference = bn_cls(CHANNELS, momentum=momentum).double()
    with torch.no_grad():
        reference.weight.copy_(torch.rand(CHANNELS, generator=gen) + 0.5)
        reference.bias.copy_(torch.randn(CHANNELS, generator=gen))
    synced, _ = convert_sync_batchnorm(nn.Sequential(bn_cls(CHANNELS, momentum=momentum)), len(counts), "cpu")
    synced[0].load_state_dict({key: value.to(torch.int64 if key.endswith("tracked") else torch.float32)
                               for key, value in reference.state_dict().items()})
    assert isinstance(synced[0], GlooSyncBatchNorm)
    start, stop = sum(counts[:rank]), sum(counts[:rank + 1])
    worst = {}
    for _ in range(ITERATIONS):
        # Channel means far from 0 and unequal scales: the regime where naive variance formulas drift.
        x = (torch.randn(sum(counts), CHANNELS, *tail, generator=gen) * 3 + 10).double().requires_grad_(True)
        upstream = torch.randn(x.shape, generator=gen).double()
        out_ref = reference(x)
        out_ref.backward(upstream)
        local_x = x.detach()[start:stop].float().contiguous(memory_format=memory_format).requires_grad_(True)
        out = synced(local_x)
        out.backward(upstream[start:stop].float().contiguous(memory_format=memory_format))
        grads = torch.cat([synced[0].weight.grad, synced[0].bias.grad])
        dist.all_reduce(grads)  # DDP would average; the sum over ranks is the global-batch gradient
        ref_grads = torch.cat([reference.weight.grad, reference.bias.grad])
        diffs = {
            "output": (out - out_ref[start:stop]).abs().max().item() if stop > start else 0.0,
            "input_grad": (local_x.grad - x.grad[start:stop]).abs().max().item() if stop > start else 0.0,
            "param_grad": ((grads - ref_grads).abs().max() / ref_grads.abs().max()).item(),
            "running_mean": (synced[0].running_mean - reference.running_mean).abs().max().item(),
            "running_var": (synced[0].running_var - reference.running_var).abs().max().item(),
            "num_batches_tracked": abs(int(synced[0].num_batches_tracked) - int(reference.num_batches_tracked)),
        }
        for key, value in diffs.items():
            worst[key] = max(worst.get(key, 0.0), value)
        reference.zero_grad()
        synced.zero_grad()
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    env = detect_from_process()
    with distributed_session(env):
        assert env.world_size == len(counts), (env.world_size, counts)
        results = {name: run_case(name, counts, env.rank) for name in CASES}
        gathered = comm.gather_objects(results)
        if env.is_main:
            merged = {name: {key: max(r[name][key] for r in gathered) for key in gathered[0][name]}
                      for name in CASES}
            with open(args.out, "w") as handle:
                json.dump(merged, handle, indent=1)


if __name__ == "__main__":
    main()
