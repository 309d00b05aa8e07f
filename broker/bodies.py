"""A fresh `bytes` body written in place, so the encoder can check each piece of a tensor right
after copying it, while the piece is still in the core's cache.

`bytes.join` is the only standard way to build a body without a second copy, and it makes all
its copies in one call, so the encoder's finite check has to read every source tensor on its
own: one more pass over memory than the copy itself. A 16 MiB encode + decode takes about a
quarter less time written in place (docs/benchmarks.md, codec section: the "body joined" row).

`fresh_body` allocates the body uninitialised, as C code builds a bytes object
(`PyBytes_FromStringAndSize(NULL, n)`), and hands out a writable numpy view of its storage.
Like that C code, the caller fills every byte before the object is hashed or shared and drops
the view first. CPython only: elsewhere it returns None and the encoder joins.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

# Where a bytes object's storage starts: its fixed part ends with the storage's first byte.
_DATA_OFFSET = bytes.__basicsize__ - 1


def _bytes_constructor() -> Callable[[None, int], bytes] | None:
    if sys.implementation.name != "cpython":
        return None
    # A private prototype: setting restype on `ctypes.pythonapi.PyBytes_FromStringAndSize`
    # would change it for every other user of that shared attribute. PYFUNCTYPE keeps the GIL.
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
    constructor: Callable[[None, int], bytes] = prototype(
        ("PyBytes_FromStringAndSize", ctypes.pythonapi)
    )
    return constructor


_NEW_BYTES = _bytes_constructor()


class _Window:
    """`size` writable bytes at `address`, as numpy sees them (`__array_interface__`)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, size: int) -> None:
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }


def fresh_body(size: int) -> tuple[bytes, np.ndarray[Any, np.dtype[np.uint8]]] | None:
    """A new, uninitialised `bytes` of `size` (>= 2) bytes and a writable uint8 view of its
    storage; None where that cannot be done.

    The view does not keep the bytes alive: hold the bytes while writing. Fill every byte, drop
    the view and everything made from it, and only then let the bytes go anywhere. (Sizes 0
    and 1 may return CPython's shared singletons, which must never be written.)
    """
    if _NEW_BYTES is None or size < 2:
        return None
    body = _NEW_BYTES(None, size)
    return body, np.asarray(_Window(id(body) + _DATA_OFFSET, size))
