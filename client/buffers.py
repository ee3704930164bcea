"""Flat byte views of caller buffers (bytes, bytearray, memoryview, numpy, torch), and the
receive space connections reuse for reads that return bytes."""

from __future__ import annotations

from kvstore_client.errors import InvalidValue

LANDING_MAX = 64 << 20  # the most receive space a connection keeps for get()


def byte_view(obj: object, *, writable: bool = False) -> memoryview:
    """A 1-D unsigned-byte memoryview of ``obj`` without copying.

    Raises InvalidValue for objects that do not expose a C-contiguous buffer,
    or that are read-only when ``writable`` is asked for.
    """
    if type(obj).__module__.startswith("torch"):
        obj = _torch_bytes(obj)
    try:
        mv = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidValue(f"{type(obj).__name__} does not support the buffer protocol") from None
    if not mv.c_contiguous:
        raise InvalidValue("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise InvalidValue("buffer is read-only")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _torch_bytes(tensor):  # pragma: no cover - exercised only where torch is installed
    """A CPU tensor's storage as a numpy uint8 view (no copy)."""
    if tensor.device.type != "cpu":
        raise InvalidValue("only CPU tensors can be read or written directly; copy to host first")
    if not tensor.is_contiguous():
        raise InvalidValue("tensor must be contiguous")
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class LandingBuffer:
    """Receive space that ``get`` reuses from call to call: ``take(size)`` hands out the next
    ``size`` bytes of it (a fresh buffer when it is full), ``reset()`` makes it all free again,
    grown to what the last round needed, up to ``LANDING_MAX`` bytes."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._used = self._asked = 0  # bytes handed out of the kept space / asked for, this round

    def take(self, size: int) -> memoryview:
        self._asked += size
        end = self._used + size
        if end > len(self._buffer):
            return memoryview(bytearray(size))
        view = memoryview(self._buffer)[self._used : end]
        self._used = end
        return view

    def reset(self) -> None:
        if len(self._buffer) < self._asked <= LANDING_MAX:
            self._buffer = bytearray(self._asked)
        self._used = self._asked = 0
