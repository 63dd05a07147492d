"""torchrun worker: the training step --capture takes on N GPUs, on gloo ranks over the CPU stand-ins of CUDA's
synchronized batch-norm kernels (tests/cuda_bn_kernels.py), against the eager step of the same build.

Usage: torchrun --nproc_per_node=2 capture_sync_bn_worker.py --toy ROOT --out result.json CONFIG

On N GPUs the trainer converts every BatchNorm to `DeviceSyncBatchNorm`, makes the model and the task's step a
`CaptureModule` and wraps that in DDP (engine/trainer.py). Here every rank builds that from the same weights eager
(DDP around the model, the task's step) and captured in each of MODES, whose traced graphs run by the eager kernels
on the CPU, so any difference is the capture path's: ``aot_eager`` (inductor's partition of forward and backward)
and ``cudagraphs`` (the backend --capture cudagraphs takes on CUDA: AOTAutograd's default partition, CUDA graphs
skipped for the host here). Every build runs under the kernels a captured step takes
(numerics/kernel_path.cuda_kernels_on_cpu) and takes STEPS SGD steps on one sample per rank, rank r reading
sample r. Rank 0 writes, per mode:

- ``losses_equal``: every step's loss, on every rank, the eager step's bit for bit;
- ``states_equal``: every parameter and buffer (the running statistics the collectives made included) after the
  steps, on every rank, the eager build's bit for bit;
- ``graphs`` and ``graph_breaks``: what dynamo compiled on each rank: one graph (one batch shape) and no break, the
  batch norms' collectives inside it.

torch's DDP refuses a SyncBatchNorm in a module that is not on a GPU; the check is torch's guard for its own CUDA
kernels, which the stand-ins take the place of here, so this worker lifts it.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cuda_bn_kernels  # noqa: E402
from zoo import hypes_of  # noqa: E402

from opencood_ddp.distributed import comm  # noqa: E402
from opencood_ddp.distributed.ddp import wrap_ddp  # noqa: E402
from opencood_ddp.distributed.device_sync_bn import convert_device_sync_batchnorm  # noqa: E402
from opencood_ddp.distributed.env import detect_from_process, distributed_session  # noqa: E402
from opencood_ddp.engine.capture import CapturedStep, CaptureModule  # noqa: E402
from opencood_ddp.engine.step import Precision, forward_backward  # noqa: E402
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu  # noqa: E402
from opencood_ddp.tasks import build_task  # noqa: E402

STEPS = 2
CPU = torch.device("cpu")
MODES = ("aot_eager", "cudagraphs")


def train(task, model: torch.nn.Module, batch, mode: Optional[str]) -> list:
    """STEPS SGD steps of `model` (changed in place) on this rank's batch, eager (`mode` None) or captured in the
    --capture `mode`; the losses."""
    captured = mode is not None
    module = CaptureModule(model, task.step, mode, CPU) if captured else model
    ddp = wrap_ddp(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        with cuda_kernels_on_cpu():
            out = forward_backward(CapturedStep() if captured else task.step, ddp, batch, Precision(None, CPU), None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.total.detach())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("config")
    args = parser.parse_args()
    cuda_bn_kernels.register()
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # the module docstring
    from torch._dynamo.utils import counters

    env = detect_from_process(backend="gloo")
    with distributed_session(env):
        torch.manual_seed(0)
        task = build_task(hypes_of(args.config, "preprocess.args.max_voxel_train=2000", toy_root=args.toy),
                          for_training=True)
        eager = convert_device_sync_batchnorm(task.model).train()
        batch = task.collate_train([task.train_set[env.rank]])
        captured = {mode: copy.deepcopy(eager) for mode in MODES}  # the same weights, before any trains
        eager_losses = train(task, eager, batch, None)
        found = {}
        for mode, model in captured.items():
            torch._dynamo.reset()
            counters.clear()  # this mode's graphs and breaks alone
            losses = train(task, model, batch, mode)
            found[mode] = {
                "losses_equal": all(map(torch.equal, eager_losses, losses)),
                "states_equal": all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(),
                                                                      model.state_dict().values())),
                "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
        report = comm.all_gather_objects(found)
        if env.rank == 0:
            args.out.write_text(json.dumps({mode: {key: [rank[mode][key] for rank in report] for key in found[mode]}
                                            for mode in MODES}))


if __name__ == "__main__":
    main()
