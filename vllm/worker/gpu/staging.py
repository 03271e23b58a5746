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

import math

import numpy as np
import torch

_NUMPY_DTYPES = {
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.float32: np.dtype(np.float32),
    torch.bool: np.dtype(np.bool_),
}


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
        self.np_bufs = [b.numpy() for b in self.bufs]
        self._stream_key: tuple | None = None  # (id, device, type) of the cached stream
        self._stream: torch.cuda.Stream | None = None
        self.cur, self.off = 0, 0
        self.busy = [False, False]  # an arena whose step has not been seen done
        self.events: list[torch.cuda.Event | None] = [None, None]  # recorded at each step's end

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not self.cuda:
            return torch.from_numpy(arr)
        host = self._stage(arr)
        return host if host.is_cuda else host.to(self.device, non_blocking=True)

    def copy_into(self, dst: torch.Tensor, arr: np.ndarray) -> None:
        """``dst`` (a contiguous device tensor of ``arr``'s size) := ``arr``: one copy, no
        device tensor allocated."""
        arr = np.ascontiguousarray(arr)
        if not self.cuda:
            dst.copy_(torch.from_numpy(arr).view(dst.shape))
            return
        dst.copy_(self._stage(arr).view(dst.shape), non_blocking=True)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory for a device → host copy of the step, in its arena: valid until
        the step after next writes the arena, i.e. read at the step's ``finish`` (which comes
        first: a step is read before the next but one is launched)."""
        npdt = _NUMPY_DTYPES.get(dtype)
        view = self._reserve(math.prod(shape) * npdt.itemsize) if npdt is not None else None
        if view is None:  # no numpy twin (bf16) or no room left: a pinned block of its own
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return torch.from_numpy(view.view(npdt).reshape(shape))

    def _stage(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` in this step's pinned arena (on the device already if it does not fit)."""
        view = self._reserve(arr.nbytes)
        if view is None:  # a synchronous copy (pageable memory); rare
            return torch.from_numpy(arr).to(self.device)
        # written and wrapped through numpy (torch slicing and views cost ~5-10 µs each): the
        # tensor shares the pinned pages, so its copy to the device is asynchronous
        view = view.view(arr.dtype).reshape(arr.shape)
        view[...] = arr
        return torch.from_numpy(view)

    def _reserve(self, n: int) -> np.ndarray | None:
        """``n`` bytes of this step's arena (uint8, 64-byte aligned) once the arena is free;
        None if the rest of it is too small (never reused within a step: the step's device →
        host results are in it too, unread until its finish)."""
        if self.busy[self.cur]:  # its step was not read (it had no results): wait for it
            self.events[self.cur].synchronize()
            self.busy[self.cur] = False
        if self.off + n > len(self.np_bufs[self.cur]):
            return None
        view = self.np_bufs[self.cur][self.off : self.off + n]
        self.off += (n + 63) // 64 * 64
        return view

    def stream(self) -> torch.cuda.Stream | None:
        """The stream the step's work is queued on (None on CPU). The Stream object is kept
        while the current stream stays the same (torch.cuda.current_stream builds one each
        call: ~40 µs of host time on a GPU host)."""
        if not self.cuda:
            return None
        key = torch._C._cuda_getCurrentStream(self.device.index)
        if key != self._stream_key:
            self._stream_key = key
            self._stream = torch.cuda.Stream(
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
        return self._stream

    def step_done(
        self, stream: torch.cuda.Stream | None = None, event: torch.cuda.Event | None = None
    ) -> int:
        """The step's inputs are all queued (on ``stream``, by default the current one): later
        copies go to the other arena. ``event``: one already recorded there after them (the
        step's results'), else one is recorded. Returns this step's arena, for :meth:`synced`."""
        used = self.cur
        self.busy[used] = self.cuda
        if self.cuda:
            if event is None:
                event = torch.cuda.Event()
                event.record(stream if stream is not None else self.stream())
            self.events[used] = event
        self.cur, self.off = 1 - used, 0
        # the other arena may still be busy here (step N + 1 is launched before step N is
        # read); it is checked when the next step first writes to it, after step N's sync
        return used

    def synced(self, arena: int) -> None:
        """The device has run the step that used ``arena`` (its results were read after an event
        recorded behind all of its work): recycle it. Never for a step that was not waited for."""
        self.busy[arena] = False
