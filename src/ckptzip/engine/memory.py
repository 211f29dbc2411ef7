"""Memory the engine holds: the pinned host pool, chunk alignment and segment copies."""
from __future__ import annotations

import os
import threading
import weakref

import numpy as np
import torch

from .. import native
from ..kernels import triton_kernels

ALIGN = 16  # every chunk starts at a 16-byte aligned file offset (nvCOMP's strictest alignment)


def ceil_align(n):
    """``n`` (an int or an array) rounded up to the chunk alignment, :data:`ALIGN` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


#: new host buffers of at least this many bytes are backed by 2 MiB pages where the kernel allows
#: it (32 MiB, glibc's largest mmap threshold, was tried: a 2-core load of a 19.8 MB blob, 25
#: interleaved rounds, took 20.1 ms with the advice at 4 MiB, 27.3 ms at 32 MiB, 24.4 ms without)
HUGE_MIN = 4 << 20
#: ``CKPTZIP_HUGEPAGES=0``: leave new host buffers to the kernel's default page size
HUGE_PAGES = os.environ.get("CKPTZIP_HUGEPAGES", "1") != "0"


def huge_pages(buf) -> None:
    """Ask for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) on the whole 2 MiB pages inside ``buf``, a
    new, not yet written host buffer of at least :data:`HUGE_MIN` bytes (a numpy array or a CPU
    tensor). Filling new memory costs one page fault per 4 KiB page: 40 MB took 40 ms on one
    core of a 2-core VM, 10.5 ms with 2 MiB pages. The kernel ignores the advice where
    transparent huge pages are off ("never"); with "always" it changes nothing."""
    if HUGE_PAGES and native.lib is not None:
        arr = buf.numpy() if isinstance(buf, torch.Tensor) else buf
        if arr.nbytes >= HUGE_MIN:
            native.lib.huge_pages(arr.reshape(-1).view(np.uint8))


def empty_bytes(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A new flat uint8 tensor of ``n`` bytes on ``device``; on the host, of 2 MiB pages where
    it is large (:func:`huge_pages`): for buffers that are written once in full, such as a
    load's outputs."""
    t = torch.empty(n, dtype=torch.uint8, device=device)
    if t.device.type == "cpu" and n >= HUGE_MIN:
        huge_pages(t)
    return t


def pinned_empty(n: int) -> torch.Tensor:
    """A new flat uint8 host tensor of ``n`` bytes, page-locked where CUDA is available (copies
    to and from the GPU are then asynchronous): torch's ``pin_memory=True``, whose blocks carry
    the stream events of the copies that use them, so that a buffer dropped on an error path is
    never reused while a copy is still in flight. The one place ckptzip makes the page-locked
    buffers it keeps and reuses (:class:`PinnedPool`, the async saves' arena). Registering
    ckptzip's own memory instead was measured faster and not kept (docs/benchmarks.md,
    twenty-ninth session)."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class PinnedPool:
    """Page-locked host buffers shared by saves and loads: :meth:`acquire` leases one of at
    least ``n`` bytes (the smallest free one that fits, else a new one), :meth:`release` gives it
    back. Pinning costs ~1 ms per 1.5 MB, so a load after a save reuses the save's write buffers
    instead of pinning its own. Sizes are rounded up to 8 MiB so that buffers fit later
    requests; at most ``MAX_FREE`` free buffers are kept (the smallest go first)."""

    MAX_FREE = 6
    GRAIN = 8 << 20

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, weakref.ref] = {}  # weak: a lease lost to an exception is just freed
        self._lock = threading.Lock()

    def acquire(self, n: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n]
            b = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if b is None:
            cap = max(n, 1) if n < self.GRAIN else -(-n // self.GRAIN) * self.GRAIN
            b = pinned_empty(cap)
        with self._lock:
            self._leased[b.data_ptr()] = weakref.ref(b)
        return b[:n]

    def outstanding(self) -> int:
        """How many leased buffers are still alive (leases lost to an exception lapse when their
        buffer is freed, and are forgotten here)."""
        with self._lock:
            for k in [k for k, r in self._leased.items() if r() is None]:
                del self._leased[k]
            return len(self._leased)

    def release(self, view: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire` (or a view that starts where it starts)."""
        with self._lock:
            ref = self._leased.pop(view.data_ptr(), None)
            b = ref() if ref is not None else None
            if b is None:
                return
            self._free.append(b)
            if len(self._free) > self.MAX_FREE:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


PINNED = PinnedPool()


class HostScratch:
    """Pageable host buffers for the CPU path's temporaries (group streams, read buffers,
    compressed outputs), reused once nothing refers to them any more: a fresh buffer of many
    MiB is mapped anew by malloc and pays a page fault per 4 KiB page when first written (a 40 MB
    stream: 35 ms on a 2-core VM, against 8 ms to write it again). :meth:`take` returns a tensor
    over a cached buffer whose previous view is gone (weakly tracked: every tensor, slice or
    numpy view of it keeps it taken), else a new one, cached while the cache holds at most
    ``MAX_BYTES``. Small requests get plain allocations."""

    MIN = 1 << 20
    GRAIN = 4 << 20
    MAX_BYTES = 192 << 20

    def __init__(self) -> None:
        self._bufs: list[list] = []  # [numpy buffer, weakref to the view handed out, or None]
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        if n < self.MIN:
            return torch.empty(n, dtype=torch.uint8)
        def idle(e: list) -> bool:  # no view of it is alive
            return e[1] is None or e[1]() is None
        with self._lock:
            free = [e for e in self._bufs if e[0].size >= n and idle(e)]
            if free:
                e = min(free, key=lambda e: e[0].size)
            else:
                cap = -(-n // self.GRAIN) * self.GRAIN
                e = [np.empty(cap, dtype=np.uint8), None]
                huge_pages(e[0])
                held = sum(b[0].size for b in self._bufs)
                if held + cap > self.MAX_BYTES:  # make room: drop free buffers, smallest first
                    for f in sorted(filter(idle, self._bufs), key=lambda b: b[0].size):
                        if held + cap <= self.MAX_BYTES:
                            break
                        self._bufs = [b for b in self._bufs if b is not f]  # (by identity: entries hold arrays)
                        held -= f[0].size
                if held + cap <= self.MAX_BYTES:
                    self._bufs.append(e)
            view = e[0][:n]
            e[1] = weakref.ref(view)
            return torch.from_numpy(view)


HOST = HostScratch()


def free_gpu_bytes() -> int:
    """Free memory of the current CUDA device as this process can use it: what the driver
    reports free plus what torch's caching allocator holds without using (a save right after
    another finds its memory there, not in the driver's free count)."""
    free, _total = torch.cuda.mem_get_info()
    return free + max(0, torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def copy_segments(src: torch.Tensor, soffs: np.ndarray, dst: torch.Tensor, doffs: np.ndarray,
                  lens: np.ndarray, ends: np.ndarray | None = None, start_kernels: bool = True) -> None:
    """dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]] for every i (flat uint8 tensors, same
    device), and dst[doffs[i]+lens[i]:doffs[i]+ends[i]] zeroed where ``ends`` is given. On CUDA,
    one Triton kernel launch for all; elsewhere, one copy per run of adjacent segments.
    ``start_kernels=False`` (loads): see :func:`ckptzip.kernels.triton_kernels`."""
    if not len(lens):
        return
    ends = lens if ends is None else ends
    tk = triton_kernels(start=start_kernels) if src.is_cuda else None
    if tk is not None:
        tk.copy_segments(src, soffs, dst, doffs, lens, ends)
        return
    # merge runs of segments that are adjacent on both sides (only a run's last one has padding)
    brk = np.ones(len(lens), dtype=bool)
    brk[1:] = ((soffs[1:] != soffs[:-1] + lens[:-1]) | (doffs[1:] != doffs[:-1] + lens[:-1])
               | (ends[:-1] != lens[:-1]))
    if not brk.all():
        starts = np.nonzero(brk)[0]
        last = np.append(starts[1:], len(lens)) - 1
        pads = (ends - lens)[last]
        lens, soffs, doffs = np.add.reduceat(lens, starts), soffs[starts], doffs[starts]
        ends = lens + pads
    for s, d, n, e in zip(soffs.tolist(), doffs.tolist(), lens.tolist(), ends.tolist()):
        dst[d:d + n].copy_(src[s:s + n])
        if e > n:
            dst[d + n:d + e].zero_()
