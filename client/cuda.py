"""CUDA tensors as SDK buffers: the device side of puts and reads.

``buffer_view`` (``kvstore_client.buffers``) makes a ``DeviceView`` of a contiguous CUDA
tensor; the transports hand it to the few functions here where bytes cross between host
memory and the GPU:

- same host: a read copies from the node's arena straight into GPU memory
  (``DeviceView.fill_from_host``) and a put from GPU memory straight into arena space
  (``copy_to_host``). The arena mapping is registered as pinned memory
  (``cudaHostRegister``, once per mapping, when a GPU copy first touches it; unregistered
  just before it is unmapped), so the GPU's copy engine reads and writes it directly;
- TCP and Unix sockets: bytes go through a bounded pool of pinned staging buffers
  (``StagingPool``), chunk by chunk, each chunk's copy on the stream while the next chunk
  moves on the socket (``receive_into``, ``send_from``).

Streams: every copy runs on the calling thread's current stream of the tensor's device, so
it follows the work the caller already queued there (a kernel that filled the tensor, or
one that still reads it). The SDK waits on an event recorded after its own copies, never on
the device, and only where it must: before it checks a copy (a one-sided read's sequence
number, a lease's TTL), before it hashes bytes a copy brought to host memory, before it
reuses a staging buffer, and before the call returns (the bytes are in place then).

Checksums stay end to end from the node to this host's memory: the XXH3-64 is computed by
the CPU over host bytes. A same-host read hashes the arena bytes the copy engine reads,
while it reads them (a copy that ends after its slot changed or its lease lapsed is
rejected as for host buffers); a same-host put hashes the arena bytes once the copy from
the GPU has landed there (what readers verify); a socket read hashes each chunk as it lands
in staging, before it goes to the GPU; a socket put hashes each staged chunk as it is sent.
The hop between host memory and GPU memory is not covered by the checksum (PCIe's link CRC
and the GPU's ECC cover it).

torch is imported only when a CUDA tensor is used, so the SDK runs without it. What needs a
GPU is marked "(CUDA)"; the rest (device checks, staging accounting, chunking) is plain
logic, tested on CPU. ``python -m bench.gpu_check`` exercises the CUDA parts on a GPU.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import final

from kvstore_client import arenamap
from kvstore_client.errors import DeviceUnavailable, InvalidValue
from kvstore_client.slices import value_checksum

log = logging.getLogger(__name__)
CHUNK = 4 << 20  # bytes per staging buffer: one copy each
STAGING_BUFFERS = 8  # staging buffers per device at most (pinned host memory: CHUNK each)
DEPTH = 3  # staging buffers one transfer uses in turn: one on the socket, the others copying

_checksum = value_checksum


def _torch():
    import torch

    return torch


# -- which buffers ------------------------------------------------------------------------------
def is_device_tensor(obj) -> bool:
    """Whether ``obj`` is a torch tensor outside host memory (CUDA, meta, ...)."""
    return (
        type(obj).__module__.startswith("torch")
        and getattr(obj, "device", None) is not None
        and obj.device.type != "cpu"
    )


def device_problem(device_type: str, index: int | None, cuda_available: bool, device_count: int) -> str | None:
    """Why a tensor on ``device_type:index`` cannot be a buffer here, or None when it can."""
    if device_type != "cuda":
        return f"a tensor on {device_type}: the SDK reads and writes CPU and CUDA tensors only"
    if not cuda_available:
        return "a CUDA tensor, but torch has no usable CUDA in this process"
    if index is not None and not 0 <= index < device_count:
        return f"a tensor on cuda:{index}, but this process sees {device_count} CUDA device(s)"
    return None


def device_view(tensor) -> "DeviceView":
    """A DeviceView of a CUDA tensor; DeviceUnavailable for a device this process cannot use,
    InvalidValue for a tensor that is not contiguous."""
    torch = _torch()
    device = tensor.device
    available = device.type == "cuda" and torch.cuda.is_available()
    problem = device_problem(device.type, device.index, available, torch.cuda.device_count() if available else 0)
    if problem is not None:
        raise DeviceUnavailable(problem, str(device))
    if not tensor.is_contiguous():
        raise InvalidValue("tensor must be contiguous")
    return DeviceView(tensor.detach().reshape(-1).view(torch.uint8))


@final  # the data path tells it from a memoryview by ``type(x) is DeviceView``
class DeviceView:
    """Bytes ``start:stop`` of a flat uint8 CUDA tensor: what the transports get for a CUDA
    buffer. Only ``len`` and slicing (step 1) are shared with memoryview; the copies are the
    functions of this module."""

    __slots__ = ("flat", "start", "stop")

    def __init__(self, flat, start: int = 0, stop: int | None = None):
        self.flat = flat
        self.start = start
        self.stop = flat.numel() if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    def __getitem__(self, part: slice) -> "DeviceView":
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise TypeError("a DeviceView slices with step 1 only")
        start, stop, _ = part.indices(len(self))
        return DeviceView(self.flat, self.start + start, self.start + max(start, stop))

    @property
    def device(self):
        return self.flat.device

    def tensor(self):
        """The bytes as a uint8 CUDA tensor (a view)."""
        return self.flat[self.start : self.stop]

    def fill_from_host(self, src: memoryview, checksum: int, verify: bool) -> bool:
        """``checked_copy.copy_verified`` into device memory (CUDA): copy ``src`` (host memory,
        an arena mapping is registered first) here and hash it on the CPU meanwhile; returns
        once the copy is done, whether ``src`` matched ``checksum`` (True without ``verify``)."""
        torch = _torch()
        host = _host_tensor(src)
        _pin_arena_of(host)
        stream = torch.cuda.current_stream(self.flat.device)
        self.tensor().copy_(host, non_blocking=True)
        done = _record(torch, stream)
        intact = not verify or _checksum(src) == checksum  # while the copy engine reads the same bytes
        done.synchronize()
        return intact

    def receive(self, reader, hasher) -> None:
        """Fill from ``reader`` (a FrameReader) through staging (CUDA); see ``receive_into``."""
        receive_into(reader, self, hasher)


def _host_tensor(view: memoryview):
    """A CPU uint8 tensor over ``view``'s memory (no copy)."""
    torch = _torch()
    if not view.readonly:  # torch warns of read-only buffers only
        return torch.frombuffer(view, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only sources: the tensor is only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _record(torch, stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def copy_to_host(pairs: list[tuple[memoryview, DeviceView]]) -> None:
    """Copy each DeviceView into its host view (arena space: registered first), all queued
    before one wait (CUDA). Returns once every byte is in host memory."""
    torch = _torch()
    streams: dict = {}  # device -> its current stream
    for dst, src in pairs:
        host = _host_tensor(dst)
        _pin_arena_of(host)
        host.copy_(src.tensor(), non_blocking=True)
        streams.setdefault(src.flat.device, torch.cuda.current_stream(src.flat.device))
    for event in [_record(torch, stream) for stream in streams.values()]:
        event.synchronize()


# -- staging through pinned host memory ------------------------------------------------------------
class StagingPool:
    """At most ``limit`` staging buffers of ``chunk`` bytes, made by ``allocate(chunk)`` on
    first need and kept. ``take(n)`` waits for one buffer, then adds up to ``n - 1`` more only
    if they are free at once, so a transfer that holds buffers never waits for more and
    transfers on many threads cannot deadlock; ``give_back`` returns them. Thread-safe."""

    def __init__(self, allocate, chunk: int = CHUNK, limit: int = STAGING_BUFFERS):
        if limit < 1 or chunk < 1:
            raise ValueError("a staging pool needs at least one buffer of at least one byte")
        self._allocate, self.chunk, self.limit = allocate, chunk, limit
        self._free: list = []
        self.made = 0  # buffers allocated so far
        self.lent = 0  # buffers held by transfers now
        self._ready = threading.Condition()

    def take(self, n: int, timeout: float | None = None) -> list:
        with self._ready:
            got = [self._one(wait=True, timeout=timeout)]
            while len(got) < n:
                more = self._one(wait=False)
                if more is None:
                    break
                got.append(more)
            return got

    def _one(self, wait: bool, timeout: float | None = None):
        """One buffer (the lock held): a free one, a new one under the limit, else wait."""
        while True:
            if self._free:
                self.lent += 1
                return self._free.pop()
            if self.made < self.limit:
                self.made += 1
                self.lent += 1
                try:
                    return self._allocate(self.chunk)
                except BaseException:
                    self.made -= 1
                    self.lent -= 1
                    raise
            if not wait:
                return None
            if not self._ready.wait(timeout):
                raise TimeoutError("no staging buffer came free")

    def give_back(self, buffers: list) -> None:
        with self._ready:
            self._free.extend(buffers)
            self.lent -= len(buffers)
            self._ready.notify(len(buffers))


def chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of ``size`` bytes, ``chunk`` at most each."""
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


_pools: dict = {}
_pools_lock = threading.Lock()


def staging_pool(device) -> StagingPool:
    """The process's staging pool for ``device`` (pinned host buffers: CUDA)."""
    with _pools_lock:
        pool = _pools.get(device)
        if pool is None:
            pool = _pools[device] = StagingPool(_pinned_buffer)
        return pool


def _pinned_buffer(size: int):
    """(pinned uint8 tensor, writable memoryview of it) (CUDA)."""
    torch = _torch()
    tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return tensor, memoryview(tensor.numpy()).cast("B")


def receive_into(reader, out: DeviceView, hasher) -> None:
    """Receive ``len(out)`` bytes from ``reader`` into device memory (CUDA): each chunk lands
    in a pinned staging buffer (hashed as it lands, by ``FrameReader.readinto``), then is
    copied to the GPU while the next chunk is received into the next buffer."""
    torch = _torch()
    pieces = chunks(len(out), CHUNK)
    pool = staging_pool(out.device)
    buffers = pool.take(min(DEPTH, len(pieces)))
    stream = torch.cuda.current_stream(out.device)
    events: list = [None] * len(buffers)
    try:
        for k, (start, length) in enumerate(pieces):
            i = k % len(buffers)
            if events[i] is not None:
                events[i].synchronize()  # its previous chunk is on the GPU: the buffer is free
            tensor, view = buffers[i]
            reader.readinto(view[:length], hasher)
            out.flat[out.start + start : out.start + start + length].copy_(tensor[:length], non_blocking=True)
            events[i] = _record(torch, stream)
    finally:
        for event in events:
            if event is not None:
                event.synchronize()
        pool.give_back(buffers)


def send_from(sock, src: DeviceView, hasher) -> None:
    """Send ``src``'s bytes on ``sock`` (CUDA): chunks are copied from the GPU into pinned
    staging buffers ahead of the socket, and each is hashed and sent once it is in."""
    torch = _torch()
    pieces = chunks(len(src), CHUNK)
    pool = staging_pool(src.device)
    buffers = pool.take(min(DEPTH, len(pieces)))
    stream = torch.cuda.current_stream(src.device)
    events: list = [None] * len(pieces)

    def stage(k: int) -> None:
        start, length = pieces[k]
        tensor = buffers[k % len(buffers)][0]
        tensor[:length].copy_(src.flat[src.start + start : src.start + start + length], non_blocking=True)
        events[k] = _record(torch, stream)

    try:
        for k in range(min(len(buffers), len(pieces))):
            stage(k)
        for k, (_, length) in enumerate(pieces):
            events[k].synchronize()
            view = buffers[k % len(buffers)][1][:length]
            hasher.update(view)
            sock.sendall(view)
            if k + len(buffers) < len(pieces):
                stage(k + len(buffers))
    finally:
        for event in events:
            if event is not None:
                event.synchronize()
        pool.give_back(buffers)


# -- arena mappings as pinned memory --------------------------------------------------------------
_registered: list[tuple[int, int]] = []  # (start, end) of mappings registered (or found not registrable)
_registered_lock = threading.Lock()


def _pin_arena_of(host) -> None:
    """Register the arena mapping ``host`` (a CPU tensor over host memory) lies in as pinned
    memory, once per mapping (CUDA). Memory outside any arena mapping is left as it is: the
    copy then runs from pageable memory, correct and slower."""
    address = host.data_ptr()
    for start, end in _registered:
        if start <= address < end:
            return
    found = arenamap.mapping_at(address)
    if found is None:
        return
    handle, view = found
    with _registered_lock:
        base = _host_tensor(view).data_ptr()
        span = (base, base + len(view))
        if span in _registered:
            return
        ok = _host_register(base, len(view))
        _registered.append(span)
    if not arenamap.on_unmap(handle, lambda: _forget(span, ok)):
        _forget(span, ok)  # unmapped meanwhile


def _forget(span: tuple[int, int], registered: bool) -> None:
    with _registered_lock:
        if span in _registered:
            _registered.remove(span)
        if registered:
            _host_unregister(span[0])


def _host_register(address: int, size: int) -> bool:
    """cudaHostRegister (portable) of a host range (CUDA); False, logged, when refused."""
    torch = _torch()
    error = int(torch.cuda.cudart().cudaHostRegister(address, size, 1))
    if error:
        log.warning(
            "cudaHostRegister of a node arena (%d bytes) failed (CUDA error %d): GPU copies with it "
            "run from pageable memory",
            size,
            error,
        )
        return False
    return True


def _host_unregister(address: int) -> None:
    """cudaHostUnregister (CUDA), before the mapping goes."""
    try:
        error = int(_torch().cuda.cudart().cudaHostUnregister(address))
    except Exception as exc:  # unmapping must go on
        log.warning("cudaHostUnregister of a node arena failed: %s", exc)
        return
    if error:
        log.warning("cudaHostUnregister of a node arena failed (CUDA error %d)", error)


# -- streams and events (for the vLLM connector) -------------------------------------------------
def record_event(device):
    """An event recorded now on the calling thread's current stream of ``device`` (CUDA)."""
    torch = _torch()
    return _record(torch, torch.cuda.current_stream(device))


def new_stream(device):
    """A stream of its own on ``device`` (CUDA)."""
    return _torch().cuda.Stream(device=device)


__all__ = [
    "DeviceView",
    "StagingPool",
    "chunks",
    "copy_to_host",
    "device_problem",
    "device_view",
    "is_device_tensor",
    "receive_into",
    "record_event",
    "send_from",
    "staging_pool",
]
