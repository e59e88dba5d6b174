"""Compiled page copy ops (kvrelay._C) with a numba fallback of the same signature."""

from kvrelay.cuda_ext.backend import BACKEND_NAME, compiled_module
from kvrelay.cuda_ext.ops import (
    gather_pages,
    rect_geometry,
    scatter_pages,
    slot_mapping_from_block_table,
)

__all__ = [
    "BACKEND_NAME",
    "compiled_module",
    "gather_pages",
    "rect_geometry",
    "scatter_pages",
    "slot_mapping_from_block_table",
]
