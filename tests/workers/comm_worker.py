"""torchrun worker: every helper of opencood_ddp.distributed.comm on a real gloo group.

Rank 0 writes what each collective returned on every rank, for the test to check.
"""
import argparse
import datetime
import json

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import detect_from_process, distributed_session
from opencood_ddp.errors import ConfigError


def fail_on_rank0():
    raise ConfigError("rank 0 could not create the run folder")


def observations(rank: int) -> dict:
    seen = {"world_size": comm.get_world_size(), "rank": comm.get_rank()}
    seen["sum"] = comm.all_reduce_sum([rank + 0.5, 1.0]).tolist()
    seen["broadcast"] = comm.broadcast_object({"from": rank, "payload": [1, 2, 3]})
    seen["on_main"] = comm.on_main_then_broadcast(lambda: f"made by rank {comm.get_rank()}")
    try:
        comm.on_main_then_broadcast(fail_on_rank0)
        seen["on_main_error"] = None
    except ConfigError as exc:
        seen["on_main_error"] = str(exc)
    # Ranks 1.. fail on their own; every rank must get rank 1's error, and the flags summed over ranks.
    error, flags = comm.agree(ConfigError(f"frame of rank {rank}") if rank >= 1 else None, flags=[rank == 0, 1])
    seen["agree"] = [str(error), flags]
    seen["agree_none"] = [comm.first_error(None), comm.agree(None, flags=[2.0])[1]]
    comm.barrier()
    return seen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--separate_control_group", action="store_true",
                        help="run the helpers on a gloo group of their own, as under NCCL")
    args = parser.parse_args()
    env = detect_from_process()
    with distributed_session(env):
        if args.separate_control_group:
            comm.open_control_group(datetime.timedelta(minutes=1), separate=True)
            if comm.control_group() is None:
                raise SystemExit("no separate control group")
        gathered = comm.gather_objects(observations(env.rank))
        if env.is_main:
            with open(args.out, "w") as handle:
                json.dump(gathered, handle)
        elif gathered is not None:
            raise SystemExit("gather_objects returned a list on a rank other than the destination")


if __name__ == "__main__":
    main()
