"""Who is who in a V2X-ViT batch: the CAVs of all samples, one after the other, and what the model knows of each.

The BEV maps of a batch are packed: row ``r`` of the (N, H, W, C) tensor is CAV ``slot[r]`` of sample
``sample[r]``, the ego first in each sample (``record_len`` counts them). Everything but the agent attention
works per map, so it runs on the N real maps only; the agent attention pads them to (B, L, ...) with
L = the largest record_len of the batch, and masks the padded slots as keys. Upstream pads every sample to
max_cav instead and runs all layers on the padded maps too; the ego's output is the same.

Per CAV the batch may carry (upstream's keys; absent, OPV2V's case: vehicles only, no delay, no correction):

- ``prior_encoding`` (B, max_cav, 3): [speed, time delay in frames of 100 ms, infrastructure flag 0/1];
  the speed is not used by the model (upstream's neither);
- ``spatial_correction_matrix`` (B, max_cav, 4, 4): the ego's delayed pose -> its current one;
- ``pairwise_t_matrix`` (B, max_cav, max_cav, 4, 4): entry [i, 0] maps CAV i's frame into the ego's. With
  ``proj_first`` (upstream's V2X-ViT always) it is the identity; upstream ignores it and would misplace the
  maps of a dataset that does not project first, so here each map is moved by correction @ pairwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from opencood_ddp.models.modules.cav_layout import counts, sample_and_slot, to_device

VEHICLE, INFRASTRUCTURE = 0, 1
NUM_KINDS = 2
PRIOR_DELAY, PRIOR_INFRA = 1, 2


@dataclass(frozen=True)
class Agents:
    """The packed CAVs of one batch (see the module docstring); every tensor has one entry per CAV, on the maps'
    device. ``kinds`` and ``delays`` are the same as Python ints: the rows of each kind and the delays' range
    are read from them, so that nothing waits for the device (``from_batch`` fills them from the host's copy;
    left empty, they are read back from the tensors once)."""

    record_len: Tuple[int, ...]
    sample: torch.Tensor  # (N,) long
    slot: torch.Tensor  # (N,) long, 0 for each sample's ego
    delay: torch.Tensor  # (N,) long, in frames
    kind: torch.Tensor  # (N,) long, VEHICLE or INFRASTRUCTURE
    to_ego: torch.Tensor  # (N, 4, 4) into the ego's current frame; identity for the ego
    kinds: Tuple[int, ...] = ()
    delays: Tuple[int, ...] = ()
    # The rows the layers select, made with the rest: where the batch is laid out (eagerly, on the host), not on
    # first use inside the model. A lazy property would be made inside --capture's compiled dense step, and dynamo
    # breaks the graph at functools.cached_property's lock (an RLock on Python 3.11): 7 breaks in a V2X-ViT step.
    ego_rows: torch.Tensor = field(init=False, repr=False, compare=False)
    other_rows: torch.Tensor = field(init=False, repr=False, compare=False)
    rows_of_kind: Tuple[torch.Tensor, ...] = field(init=False, repr=False, compare=False)  # VEHICLE first

    def __post_init__(self):
        if len(self.kinds) != len(self.kind):
            object.__setattr__(self, "kinds", tuple(int(k) for k in self.kind.tolist()))
        if len(self.delays) != len(self.delay):
            object.__setattr__(self, "delays", tuple(int(d) for d in self.delay.tolist()))
        egos = _starts(self.record_len)
        object.__setattr__(self, "ego_rows", self._rows(egos))
        object.__setattr__(self, "other_rows", self._rows([r for r in range(len(self.kinds)) if r not in egos]))
        # The rows of each kind (empty where a kind is absent).
        object.__setattr__(self, "rows_of_kind", tuple(self._rows([r for r, k in enumerate(self.kinds) if k == kind])
                                                       for kind in range(NUM_KINDS)))

    @property
    def num_samples(self) -> int:
        return len(self.record_len)

    @property
    def max_len(self) -> int:
        return max(self.record_len)

    def _rows(self, rows: Sequence[int]) -> torch.Tensor:
        return to_device(torch.tensor(list(rows), dtype=torch.long), self.slot.device)

    def kinds_present(self) -> Tuple[int, ...]:
        return tuple(sorted(set(self.kinds)))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros in the padded slots."""
        flat = self.sample * self.max_len + self.slot
        padded = x.new_zeros((self.num_samples * self.max_len,) + tuple(x.shape[1:]))
        return padded.index_put((flat,), x).view((self.num_samples, self.max_len) + tuple(x.shape[1:]))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)."""
        return x.reshape((-1,) + tuple(x.shape[2:]))[self.sample * self.max_len + self.slot]

    @classmethod
    def from_batch(cls, data_dict: Mapping, max_cav: int, device: torch.device) -> "Agents":
        """From the batch's record_len and the optional per-CAV keys (defaults when absent), worked out where
        record_len is (the host in our batches: modules/cav_layout.py) and moved to ``device``."""
        record_len_tensor = data_dict["record_len"]
        record_len = counts(record_len_tensor)
        if not record_len or min(record_len) < 1 or max(record_len) > max_cav:
            raise ValueError(f"record_len {list(record_len)}: every sample needs 1 to max_cav ({max_cav}) CAVs; "
                             f"set model.args.max_cav to the dataset's train_params.max_cav")
        sample, slot = sample_and_slot(record_len_tensor)
        prior = _per_cav(data_dict.get("prior_encoding"), sample, slot, "prior_encoding", (3,))
        delay = kind = torch.zeros_like(slot)
        if prior is not None:
            delay = _whole(prior[:, PRIOR_DELAY], "prior_encoding time delay (column 1)", 0, None)
            kind = _whole(prior[:, PRIOR_INFRA], "prior_encoding infrastructure flag (column 2)", VEHICLE,
                          INFRASTRUCTURE)
        to_ego = _to_ego(data_dict, sample, slot)
        kinds, delays = tuple(int(k) for k in kind.tolist()), tuple(int(d) for d in delay.tolist())
        device = torch.device(device)
        return cls(record_len, *(to_device(t, device) for t in (sample, slot, delay, kind, to_ego)), kinds, delays)


def _starts(record_len: Sequence[int]) -> List[int]:
    """The row of each sample's ego."""
    starts, row = [], 0
    for n in record_len:
        starts.append(row)
        row += n
    return starts


def _per_cav(value: Optional[torch.Tensor], sample: torch.Tensor, slot: torch.Tensor, key: str,
             tail: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """(B, max_cav, *tail) batch key -> (N, *tail) rows of the real CAVs, or None when the key is absent."""
    if value is None:
        return None
    if value.dim() != 2 + len(tail) or tuple(value.shape[2:]) != tail or value.shape[0] <= int(sample.max()) \
            or value.shape[1] <= int(slot.max()):
        raise ValueError(f"batch key {key} has shape {tuple(value.shape)}; expected (batch, max_cav, "
                         f"{', '.join(map(str, tail))}) covering record_len")
    return value.to(sample.device)[sample, slot]


def _whole(column: torch.Tensor, what: str, low: int, high: Optional[int]) -> torch.Tensor:
    """Float column -> long, refusing values that are not whole numbers in [low, high]."""
    rounded = torch.round(column.double())
    bad = (rounded - column.double()).abs() > 1e-3
    bad |= rounded < low
    if high is not None:
        bad |= rounded > high
    if bool(bad.any()):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{what} must hold whole numbers {span}, got {column[bad].tolist()}")
    return rounded.long()


def _to_ego(data_dict: Mapping, sample: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """(N, 4, 4) float64: correction @ pairwise[i -> ego] per non-ego CAV, identity for the ego."""
    eye = torch.eye(4, dtype=torch.float64, device=sample.device).expand(sample.numel(), 4, 4)
    correction = _per_cav(data_dict.get("spatial_correction_matrix"), sample, slot, "spatial_correction_matrix",
                          (4, 4))
    pairwise = data_dict.get("pairwise_t_matrix")
    to_ego = eye if correction is None else correction.double()
    if pairwise is not None:
        into_ego = _per_cav(pairwise[:, :, 0], sample, slot, "pairwise_t_matrix", (4, 4))
        to_ego = to_ego @ into_ego.double()
    # The ego is never moved: upstream leaves its map alone, whatever pairwise[0, 0] holds (the identity here).
    return torch.where((slot == 0).view(-1, 1, 1), eye, to_ego)
