"""Host → device copies of per-step inputs without blocking the host.

On CUDA a copy from pageable memory stalls the CPU until it is staged; copies from pinned memory
with non_blocking=True do not. Each step's small input arrays go through one pinned arena that is
recycled after the step's single device → host sync (by then every earlier copy has finished).
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, nbytes: int = 32 << 20):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if self.cuda else None
        self.off = 0

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not self.cuda:
            return torch.from_numpy(arr)
        n = arr.nbytes
        if self.off + n > self.buf.numel():
            torch.cuda.current_stream(self.device).synchronize()  # arena full: rare, keeps it safe
            self.off = 0
            if n > self.buf.numel():
                return torch.from_numpy(arr).to(self.device)
        chunk = self.buf[self.off : self.off + n]
        chunk.numpy()[:] = arr.view(np.uint8).reshape(-1)
        self.off += (n + 63) // 64 * 64
        host = chunk.view(torch.from_numpy(arr[:0]).dtype).view(arr.shape)
        return host.to(self.device, non_blocking=True)

    def synced(self) -> None:
        """The device has caught up with the host (after the step's sync): recycle the arena."""
        self.off = 0
