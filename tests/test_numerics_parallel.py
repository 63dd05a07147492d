"""opencood_ddp/numerics/parallel.py: the ranges cover the work in order, and run_parts returns only when every
part has finished, re-raising a part's error, in process on real threads."""
from __future__ import annotations

import threading
import time

import pytest

from opencood_ddp.numerics.parallel import even_ranges, run_parts


@pytest.mark.parametrize("length, parts", [(10, 3), (3, 8), (1, 1), (1024, 2), (7, 7)])
def test_even_ranges_cover_the_length_in_order_with_near_equal_parts(length, parts):
    ranges = even_ranges(length, parts)
    assert [index for start, stop in ranges for index in range(start, stop)] == list(range(length))
    assert len(ranges) == min(parts, length)
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_every_part_runs_once_and_the_others_on_other_threads():
    seen = []
    run_parts(lambda index: seen.append((index, threading.get_ident())), [(index,) for index in range(3)])
    assert sorted(index for index, _ in seen) == [0, 1, 2]
    assert dict(seen)[0] == threading.get_ident()  # the first part runs in the calling thread


def test_a_failing_part_is_re_raised_after_the_slow_parts_have_finished():
    finished = []

    def part(index: int) -> None:
        if index == 0:
            raise ValueError("part 0")
        time.sleep(0.2)  # still writing when part 0 has failed: run_parts must not return before this ends
        finished.append(index)

    with pytest.raises(ValueError, match="part 0"):
        run_parts(part, [(0,), (1,), (2,)])
    assert sorted(finished) == [1, 2]
