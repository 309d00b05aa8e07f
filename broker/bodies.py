"""A fresh `bytes` body written in place, so the encoder can check each piece of a tensor right
after copying it, while the piece is still in the core's cache (`bytes.join` makes all its
copies in one call). What it saves: docs/benchmarks.md, codec section; the switch and the
probe: CONTRIBUTING.md.

`fresh_body` allocates the body uninitialised, as C code builds a bytes object
(`PyBytes_FromStringAndSize(NULL, n)`, soft-deprecated by PEP 782 but not scheduled for
removal), and like that C code the caller fills every byte before the object is hashed or
shared. `probe` earns the trick once per process. A free-threaded build changes nothing: the
object is private to the calling thread until `encode` returns it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from broker.tensors import writable_alias

SWITCH = "SPLITMQ_IN_PLACE_BODIES"
_Constructor = Callable[[None, int], bytes]
_Window = np.ndarray[Any, np.dtype[np.uint8]]
_log = logging.getLogger(__name__)


def _constructor() -> _Constructor:
    # A private prototype: setting restype on `ctypes.pythonapi.PyBytes_FromStringAndSize`
    # would change it for every other user of that shared attribute. PYFUNCTYPE keeps the GIL.
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
    constructor: _Constructor = prototype(("PyBytes_FromStringAndSize", ctypes.pythonapi))
    return constructor


def probe(constructor: Callable[[], _Constructor] = _constructor) -> str | None:
    """Why writing a fresh `bytes` in place does not work on this interpreter; None if it does."""
    if sys.implementation.name != "cpython":
        return f"{sys.implementation.name} is not CPython"
    expected = bytes(range(256)) * 16 + b"end"
    try:
        body = constructor()(None, len(expected))
        if type(body) is not bytes or len(body) != len(expected):
            return f"the constructor made {type(body).__name__} of {len(body)} bytes"
        window = writable_alias(body)
        window[:] = np.frombuffer(expected, np.uint8)
        del window
        copy = bytes(bytearray(body))  # a copy made from the object's own buffer
    except Exception as exc:  # any failure means: do not use the trick
        return f"{type(exc).__name__}: {exc}"
    if body != expected or hash(body) != hash(expected) or copy != expected:
        return "a write through the window did not land in the bytes"
    return None


def enabled(environ: Mapping[str, str], probed: Callable[[], str | None]) -> bool:
    """Whether `fresh_body` may write in place: not switched off in `environ`, and `probed`
    (called only then, its reason logged) found no reason against it."""
    if environ.get(SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    reason = probed()
    if reason is not None:
        _log.info("bodies are joined, not written in place: %s", reason)
    return reason is None


@functools.cache
def _constructor_here() -> _Constructor | None:
    # The one piece of process-wide state: the verdict, decided at the first big body. The
    # switch is read here, not from a job's settings: it is about the interpreter, not the job.
    return _constructor() if enabled(os.environ, probe) else None


def fresh_body(size: int) -> tuple[bytes, _Window] | None:
    """A new, uninitialised `bytes` of `size` (>= 2) bytes and a writable uint8 view of its
    storage; None where that cannot or may not be done.

    Fill every byte, drop the view and everything made from it, and only then let the bytes go
    anywhere. (Sizes 0 and 1 may return CPython's shared singletons, which must never be written.)
    """
    constructor = _constructor_here() if size >= 2 else None
    if constructor is None:
        return None
    body = constructor(None, size)
    return body, writable_alias(body)
