"""The aten ops a piece of code dispatches, counted by name: what the op-budget and autocast tests compare with
counts derived by hand."""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """The aten ops called inside, by name (no namespace, no overload): ``with OpCalls() as ops: ...``, then
    ``ops.calls``."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
