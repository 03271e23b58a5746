"""Host → device copies of per-step inputs without blocking the host.

On CUDA a copy from pageable memory stalls the CPU until it is staged; copies from pinned memory
with non_blocking=True do not. Each step's small input arrays go through a pinned arena that is
recycled after that step's device → host sync (by then every copy it queued has finished).

Two arenas take turns: with ``--async-scheduling`` the worker builds step N + 1's inputs while
step N is still queued on the device (``ModelRunner.launch`` before ``finish``), so step N's arena
must stay untouched until its sync, and step N + 1 writes the other one. A step never finds its
arena still in use: step N + 2 is built after step N's sync (were it not, the first copy into a
busy arena would wait for the device).
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, nbytes: int = 32 << 20):
        self.device = device
        self.cuda = device.type == "cuda"
        self.bufs = (
            [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            if self.cuda
            else []
        )
        self.cur, self.off = 0, 0
        self.busy = [False, False]  # an arena whose step has not been synced

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not self.cuda:
            return torch.from_numpy(arr)
        if self.busy[self.cur]:  # its step is not synced yet: never in the runner's order
            torch.cuda.current_stream(self.device).synchronize()
            self.busy[self.cur] = False
        buf, n = self.bufs[self.cur], arr.nbytes
        if self.off + n > buf.numel():
            torch.cuda.current_stream(self.device).synchronize()  # arena full: rare, keeps it safe
            self.off = 0
            if n > buf.numel():
                return torch.from_numpy(arr).to(self.device)
        chunk = buf[self.off : self.off + n]
        chunk.numpy()[:] = arr.view(np.uint8).reshape(-1)
        self.off += (n + 63) // 64 * 64
        host = chunk.view(torch.from_numpy(arr[:0]).dtype).view(arr.shape)
        return host.to(self.device, non_blocking=True)

    def step_done(self) -> int:
        """The step's inputs are all queued: later copies go to the other arena. Returns this
        step's arena, for :meth:`synced`."""
        used = self.cur
        self.busy[used] = self.cuda
        self.cur, self.off = 1 - used, 0
        # the other arena may still be busy here (step N + 1 is launched before step N is
        # read); it is checked when the next step first writes to it, after step N's sync
        return used

    def synced(self, arena: int) -> None:
        """The device has run the step that used ``arena`` (after its sync): recycle it."""
        self.busy[arena] = False
