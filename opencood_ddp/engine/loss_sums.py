"""Sample-weighted loss sums of one rank, all-reduced on demand: the mean train and validation losses that are the
same at every world size (a mean of rank means would weigh a rank's short last batch like a full one)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from opencood_ddp.distributed import comm


class LossSums:
    """Sample-weighted sums of the loss and its parts on this rank, reduced over ranks on demand.

    `add` keeps a micro-batch's values on their device; they reach the host together when the sums are read
    (`settle`), so that a training step waits for its device once, not once per loss part and micro-batch. The
    host sums are float64 and added in the order the values came, whether settled at once or one by one."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._values: list[float] = []
        self._pending: list[tuple[torch.Tensor, int]] = []
        self.count = 0

    def add(self, total: torch.Tensor, parts: dict, n: int) -> None:
        items = {"loss": total, **parts}
        if not self.names:
            self.names = list(items)
            self._values = [0.0] * len(items)
        # Stacked first (16-bit parts promote to the widest dtype, exactly), then one cast: float32 -> float64 is
        # exact, so the host sums are those of float(value) * n. One cast, where a cast per part was a kernel
        # launch each in every step on a GPU.
        stacked = torch.stack([items[name].detach().reshape(()) for name in self.names])
        self._pending.append((stacked.to(torch.float64), n))  # (parts,) on the values' device
        self.count += n

    def settle(self, extra: Sequence[torch.Tensor] = ()) -> tuple[list[list[float]], list[float]]:
        """Bring the pending values, and the scalars `extra` (a step's gradient norm), to the host in one transfer
        and add the values; returns them, one row per `add` (the loss first) in order, and `extra`'s values."""
        if not self._pending and not extra:
            return [], []
        width = len(self.names)
        flat = [values for values, _ in self._pending] + [t.detach().reshape(1).to(torch.float64) for t in extra]
        host = torch.cat(flat).cpu().tolist()
        rows = [host[i * width:(i + 1) * width] for i in range(len(self._pending))]
        for row, (_, n) in zip(rows, self._pending):
            for i, value in enumerate(row):
                self._values[i] += value * n
        self._pending = []
        return rows, host[len(rows) * width:]

    @property
    def values(self) -> list[float]:
        self.settle()
        return self._values

    def reduced_means(self, names: Optional[list[str]] = None) -> dict:
        return self.reduced_means_and_flags(names)[0]

    def reduced_means_and_flags(self, names: Optional[list[str]] = None, flags: Sequence[float] = ()
                                ) -> tuple[dict, list[float]]:
        """The means over all ranks, and `flags` summed over ranks, in one all-reduce."""
        names = names or self.names
        values = self.values or [0.0] * len(names)
        totals = comm.all_reduce_sum(values + [float(self.count)] + list(flags))
        count = totals[len(names)].item()
        means = {name: (totals[i].item() / count if count else math.nan) for i, name in enumerate(names)}
        return means, totals[len(names) + 1:].tolist()

    def reduced_totals(self) -> dict:
        """Collective: the sums over all ranks, for a checkpoint taken in the middle of an epoch."""
        totals = comm.all_reduce_sum(self.values + [float(self.count)]).tolist()
        return {"names": list(self.names), "values": totals[:-1], "count": totals[-1]}

    @classmethod
    def carried(cls, saved: Optional[dict], holder: bool) -> "LossSums":
        """An epoch's sums resumed mid-epoch: rank 0 carries the saved totals, the others start at zero."""
        sums = cls()
        if saved and saved["names"]:
            sums.names = list(saved["names"])
            sums._values = list(saved["values"]) if holder else [0.0] * len(saved["names"])
            sums.count = int(saved["count"]) if holder else 0
        return sums

    def merge(self, other: "LossSums") -> None:
        """Add another set of sums of the same loss parts (a step's into its epoch's)."""
        if not self.names:
            self.names, self._values = list(other.names), [0.0] * len(other.names)
        self.settle()
        for i, value in enumerate(other.values):
            self._values[i] += value
        self.count += other.count
