"""One way to compile a function with numba: ``njit(cache=True, nogil=True)``, compiled per process instead of
failing where the package folder is not writable (no cache locator)."""
from __future__ import annotations

import warnings

import numba


def jit(function):
    try:
        return numba.njit(cache=True, nogil=True)(function)
    except RuntimeError as error:  # numba: "cannot cache function ...: no locator available"
        warnings.warn(f"numba cannot cache {function.__qualname__} ({error}); it is compiled in every process. "
                      "Set NUMBA_CACHE_DIR to a writable folder to compile it once.", RuntimeWarning, stacklevel=2)
        return numba.njit(nogil=True)(function)
