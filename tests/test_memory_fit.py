"""memory_fit: the allocation failures it recognises are the ones numpy and torch raise, and the sizes it names."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.memory_fit import (Buffer, asked_for, int_leaves, is_allocation_failure, largest_size,
                                     physical_memory, refuse_beyond_memory)

# 2**46 float32 words are 256 TiB, beyond x86-64's and AArch64's 128 TiB of user address space: refused whatever
# the kernel's overcommit policy
BEYOND_ANY_ADDRESS_SPACE = 2 ** 46


def raised(make) -> BaseException:
    with pytest.raises(BaseException) as caught:
        make()
    return caught.value


def test_torch_and_numpy_refusals_are_recognised_with_what_they_asked_for():
    torch_refusal = raised(lambda: torch.empty(BEYOND_ANY_ADDRESS_SPACE))
    assert is_allocation_failure(torch_refusal)
    assert asked_for(torch_refusal) == " of 262,144.0 GiB"  # 2**46 x 4 bytes
    numpy_refusal = raised(lambda: np.empty(BEYOND_ANY_ADDRESS_SPACE, dtype=np.float32))
    assert is_allocation_failure(numpy_refusal)
    assert asked_for(numpy_refusal) == " of 262,144.0 GiB"  # numpy says "256. TiB"
    overflow = raised(lambda: torch.empty(2 ** 40, 2 ** 40))
    assert is_allocation_failure(overflow) and asked_for(overflow) == ""


def test_other_errors_are_not_taken_for_allocation_failures():
    assert not is_allocation_failure(raised(lambda: torch.zeros(2, 3) @ torch.zeros(2, 3)))
    assert not is_allocation_failure(ValueError("can't allocate memory"))  # only torch's RuntimeError says it


def test_the_largest_size_names_list_entries_and_nested_keys():
    args = {"a": 3, "b": {"c": [1, 7, 2], "flag": True}, "d": 0.5}
    assert list(int_leaves(args, "model.args")) == [("model.args.a", 3), ("model.args.b.c[0]", 1),
                                                    ("model.args.b.c[1]", 7), ("model.args.b.c[2]", 2)]
    assert largest_size(args, "model.args") == "model.args.b.c[1] (7)"
    assert largest_size({"x": "text"}, "model.args") == "the sizes under model.args"


def test_a_buffer_is_refused_only_beyond_the_physical_memory():
    memory = physical_memory()
    assert memory > 2 ** 30
    refuse_beyond_memory("hypes x", [Buffer("fits", memory, "k (1)")])  # equal: not refused
    with pytest.raises(ConfigError) as caught:
        refuse_beyond_memory("hypes x", [Buffer("fits", 1, "a (1)"), Buffer("the thing", memory + 1, "k (9)", "do y")])
    assert str(caught.value).startswith("hypes x: k (9): the thing would take ")
    assert str(caught.value).endswith("of memory; do y; fix the hypes")
