"""Peak memory of this process over a stretch of work, for the benchmarks.

CUDA: torch's caching allocator, whose reserved bytes (what the process holds from the GPU: tensors plus the
allocator's cached and fragmented blocks) are what a plan must fit; the bytes allocated by tensors are reported
beside them. CPU: Linux's peak resident set (VmHWM), which `/proc/self/clear_refs` resets to the current resident
set, so the peak is of the measured stretch only.
"""
from __future__ import annotations

from pathlib import Path

import torch


def _read_status(field: str) -> int:
    """A /proc/self/status memory field in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """`start()` before the work, then `peak()` (bytes at the high-water mark) and `growth()` (over start)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.at_start = 0
        self.allocated_at_start = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.at_start = torch.cuda.memory_reserved(self.device)
            self.allocated_at_start = torch.cuda.memory_allocated(self.device)
        else:
            self.at_start = self.allocated_at_start = _read_status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)

    def peak(self) -> int:
        """The high-water mark: CUDA's reserved bytes, or the resident set on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        return _read_status("VmHWM")

    def peak_allocated(self) -> int:
        """CUDA: the high-water mark of bytes held by tensors (at most peak()); the CPU has one figure, peak()."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.peak()

    def growth(self) -> int:
        return self.peak() - self.at_start

    def growth_allocated(self) -> int:
        return self.peak_allocated() - self.allocated_at_start
