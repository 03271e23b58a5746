"""Host → device copies of per-step inputs without blocking the host.

On CUDA a copy from pageable memory stalls the CPU until it is staged; copies from pinned memory
with non_blocking=True do not. Each step's small input arrays go through a pinned arena that is
recycled after that step's device → host sync (by then every copy it queued has finished).

Two arenas take turns: with ``--async-scheduling`` the worker builds step N + 1's inputs while
step N is still queued on the device (``ModelRunner.launch`` before ``finish``), so step N's arena
must stay untouched until the device has run it, and step N + 1 writes the other one. Each step's
end records an event; the first write into an arena whose step has not been seen done waits for
that event. A step with host results is seen done at its read (``synced``), before step N + 2 is
built; a step without any (a prompt chunk that samples nothing) has no read, so its arena is
recycled through the event only: recycling it at its ``finish`` let step N + 2 overwrite the
inputs of a step still queued (garbage block tables in 64K-token prefills on an H100).
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, nbytes: int = 32 << 20):
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # an explicit index: current_stream's fast path
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.bufs = (
            [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            if self.cuda
            else []
        )
        self.cur, self.off = 0, 0
        self.busy = [False, False]  # an arena whose step has not been seen done
        self.events: list[torch.cuda.Event | None] = [None, None]  # recorded at each step's end

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not self.cuda:
            return torch.from_numpy(arr)
        if self.busy[self.cur]:  # its step was not read (it had no results): wait for it
            self.events[self.cur].synchronize()
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

    def stream(self) -> torch.cuda.Stream | None:
        """The stream the step's work is queued on (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def step_done(self, stream: torch.cuda.Stream | None = None) -> int:
        """The step's inputs are all queued (on ``stream``, by default the current one): later
        copies go to the other arena. Returns this step's arena, for :meth:`synced`."""
        used = self.cur
        self.busy[used] = self.cuda
        if self.cuda:
            self.events[used] = torch.cuda.Event()
            self.events[used].record(stream if stream is not None else self.stream())
        self.cur, self.off = 1 - used, 0
        # the other arena may still be busy here (step N + 1 is launched before step N is
        # read); it is checked when the next step first writes to it, after step N's sync
        return used

    def synced(self, arena: int) -> None:
        """The device has run the step that used ``arena`` (its results were read after an event
        recorded behind all of its work): recycle it. Never for a step that was not waited for."""
        self.busy[arena] = False
