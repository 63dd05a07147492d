"""Run a compiled kernel that releases the GIL on as many threads as torch's intra-op pool has.

Why Python threads and not numba's ``parallel=True``: numba's threading layers are either not fork-safe (its
OpenMP layer over GNU OpenMP, beside torch's own OpenMP runtime) or not thread-safe (its workqueue layer), and
a training process forks DataLoader workers after its first steps. Here each part is an ordinary call of a
``nogil`` kernel on its own slice, so the parts share nothing but the arrays they were given. The pool's
threads wait on a queue while idle; a forked child forgets the pool (it has none of its threads) and starts
its own if it ever needs one.

Callers split only work whose result does not depend on the number of parts: numerics/batch_norm.py hands
over its elementwise kernels, by rows, and keeps its per-column sums in one thread.
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch

# Below this many elements a part costs more to hand over (about 30 us a part) than it saves.
MIN_ELEMENTS_PER_PART = 1 << 16

_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_workers = 0


def _forget_pool() -> None:
    global _pool, _pool_workers
    _pool, _pool_workers = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _pool_with(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_workers
    if _pool is None or _pool_workers < workers:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="accurate-bn")
        _pool_workers = workers
    return _pool


def part_count(elements: int) -> int:
    """How many parts to split work on ``elements`` values into: torch's thread count, fewer for small work."""
    return max(1, min(torch.get_num_threads(), elements // MIN_ELEMENTS_PER_PART))


def even_ranges(length: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` [start, stop) ranges of near-equal length that cover range(length) in order (fewer if short)."""
    parts = max(1, min(parts, length))
    bounds = [length * i // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def run_parts(kernel: Callable[..., None], parts: Sequence[tuple]) -> None:
    """kernel(*part) for every part: the first in this thread, the others on the pool. Returns once all have
    finished (so no part still writes into a buffer the caller goes on to use), re-raising the first error."""
    if len(parts) == 1:
        kernel(*parts[0])
        return
    futures = [_pool_with(len(parts) - 1).submit(kernel, *part) for part in parts[1:]]
    try:
        kernel(*parts[0])
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()
