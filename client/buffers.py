"""Flat byte views of caller buffers (bytes, bytearray, memoryview, numpy, torch), and the
bytes objects that reads returning bytes receive into.

``byte_view`` is host memory only; ``buffer_view``, what the SDK's data path takes, also
makes a ``DeviceView`` of a CUDA tensor (``kvstore_client.cuda``)."""

from __future__ import annotations

import ctypes
from typing import Any

from kvstore_client.cuda import DeviceView, device_view
from kvstore_client.errors import InvalidValue

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize  # (NULL, n): a bytes object to fill
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA = bytes.__basicsize__ - 1  # where a bytes object's data starts (CPython's ob_sval)


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


def buffer_view(obj: Any, *, writable: bool = False) -> memoryview | DeviceView:
    """``byte_view(obj)``, except for a torch tensor in device memory: a DeviceView of a CUDA
    tensor (DeviceUnavailable for any other device, or a CUDA device this process cannot use;
    InvalidValue when not contiguous). A DeviceView is returned as it is."""
    kind = type(obj)
    if kind is DeviceView:
        return obj
    if kind.__module__.startswith("torch") and obj.device.type != "cpu":
        return device_view(obj)
    return byte_view(obj, writable=writable)


def _torch_bytes(tensor):  # pragma: no cover - exercised only where torch is installed
    """A CPU tensor's storage as a numpy uint8 view (no copy)."""
    if tensor.device.type != "cpu":
        raise InvalidValue(
            f"a tensor on {tensor.device}: only host memory here (the SDK's data path, "
            "buffer_view, takes CUDA tensors too)"
        )
    if not tensor.is_contiguous():
        raise InvalidValue("tensor must be contiguous")
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def receivable_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new bytes object of ``size`` bytes, not filled yet, and a writable view of its data,
    so that a block get() returns as bytes is received straight into it: one copy instead
    of two (receive, then copy into bytes), and no second large allocation per block. The
    view must be filled before the object is handed out, and never used after."""
    block = _new_bytes(None, size)
    return block, memoryview((ctypes.c_ubyte * size).from_address(id(block) + _BYTES_DATA)).cast("B")


def newly_allocated(view: memoryview) -> bool:
    """Whether ``view`` lies over a ctypes array, as the views ``receivable_bytes`` makes do:
    memory just allocated, whose pages the kernel may still have to fault in as the bytes
    land. (A caller's own ctypes array counts too; only how its bytes are received differs.)"""
    return isinstance(view.obj, ctypes.Array)
