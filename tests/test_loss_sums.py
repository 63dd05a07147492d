"""engine/loss_sums.py's LossSums on one process: the host sums are float64 sums of float(value) * n in the order the
values came, whatever their dtype, and a step's values reach the host in one transfer (their all-reduce over ranks is
tests/test_train_engine.py's, on real processes)."""
from __future__ import annotations

import torch

from op_calls import OpCalls
from opencood_ddp.engine.loss_sums import LossSums


def test_the_host_sums_are_float64_sums_of_each_value_times_its_count():
    """By hand: 0.1f * 3 + 0.7f * 1 in float64, not float32; a bfloat16 part is its own value exactly."""
    sums = LossSums()
    sums.add(torch.tensor(0.1), {"cls": torch.tensor(0.25, dtype=torch.bfloat16)}, 3)
    sums.add(torch.tensor(0.7), {"cls": torch.tensor(-1.5, dtype=torch.bfloat16)}, 1)
    first, second = float(torch.tensor(0.1)), float(torch.tensor(0.7))
    assert sums.values == [first * 3 + second, 0.25 * 3 - 1.5] and sums.count == 4
    assert sums.names == ["loss", "cls"]


def test_settle_reads_the_rows_and_the_extra_scalars_in_order():
    sums = LossSums()
    sums.add(torch.tensor(2.0), {"reg": torch.tensor(0.5)}, 2)
    sums.add(torch.tensor(4.0), {"reg": torch.tensor(1.0)}, 2)
    rows, extra = sums.settle(extra=[torch.tensor(3.0), torch.tensor(float("inf"))])
    assert rows == [[2.0, 0.5], [4.0, 1.0]] and extra == [3.0, float("inf")]
    assert sums.values == [12.0, 3.0]
    assert sums.settle() == ([], [])  # nothing pending


def test_a_micro_batchs_values_are_stacked_then_cast_once():
    """On a GPU each cast is a kernel launch: one stack and one cast a micro-batch, whatever the parts."""
    sums = LossSums()
    parts = {name: torch.tensor(float(i)) for i, name in enumerate(["cls", "reg", "dir"])}
    with OpCalls() as seen:
        sums.add(torch.tensor(1.0), parts, 1)
    assert seen.calls["stack"] == 1 and seen.calls["_to_copy"] == 1, seen.calls
