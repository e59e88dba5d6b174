"""Chooses the implementation of the page copy ops once, at import.

The compiled module kvrelay._C is used when it is built; otherwise (or with
KVRELAY_NO_EXT=1) the numba implementation of the same signature, after a
one-line warning on the `kvrelay` logger.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger("kvrelay")


def _load() -> tuple[str, ModuleType]:
    if os.environ.get("KVRELAY_NO_EXT") == "1":
        reason = "KVRELAY_NO_EXT=1"
    else:
        try:
            import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

            from kvrelay import _C

            return "cpp", _C
        except ImportError as exc:
            reason = f"kvrelay._C is not built ({exc})"
    from kvrelay.cuda_ext import numba_ref

    log.warning("kvrelay: %s; gather/scatter_pages use the slower numba path", reason)
    return "numba", numba_ref


BACKEND_NAME, BACKEND = _load()


def compiled_module() -> ModuleType | None:
    """kvrelay._C when it can be imported, whatever the selected backend."""
    try:
        import torch  # noqa: F401

        from kvrelay import _C
    except ImportError:
        return None
    return _C
