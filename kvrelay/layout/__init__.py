"""The unified page layout (DESIGN.md section 3): specs, rectangles, page keys,
and the placement of page keys over cache servers (`HashRing`)."""

from kvrelay.layout.draft import draft_page_keys, draft_rectangle
from kvrelay.layout.keys import KEY_SCHEMES, PageKeyChain, page_keys, tokens_as_uint32
from kvrelay.layout.parallel import (
    ParallelConfig,
    Rectangle,
    page_writers,
    rank_rectangle,
    stage_layers,
)
from kvrelay.layout.ring import HashRing, prefix_in_turns, ring_prefix
from kvrelay.layout.spec import (
    ATTENTION_KINDS,
    DEFAULT_PAGE_SIZE,
    DRAFT_POSITION_CONVENTIONS,
    KV_DTYPE_ITEMSIZE,
    LAYOUT_VERSION,
    LayoutError,
    ModelKVSpec,
)

__all__ = [
    "ATTENTION_KINDS",
    "DEFAULT_PAGE_SIZE",
    "DRAFT_POSITION_CONVENTIONS",
    "KEY_SCHEMES",
    "KV_DTYPE_ITEMSIZE",
    "LAYOUT_VERSION",
    "HashRing",
    "LayoutError",
    "ModelKVSpec",
    "PageKeyChain",
    "ParallelConfig",
    "Rectangle",
    "draft_page_keys",
    "draft_rectangle",
    "page_keys",
    "page_writers",
    "prefix_in_turns",
    "rank_rectangle",
    "ring_prefix",
    "stage_layers",
    "tokens_as_uint32",
]
