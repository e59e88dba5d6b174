"""What a model's KV cache looks like, independent of how it is parallelised.

A `ModelKVSpec` fixes the unified page layout of DESIGN.md section 3:

    page[head][layer] = K[token][k_head_dim] ++ V[token][v_head_dim]

in C order and the KV cache dtype, heads outermost so that a TP rank's share of
a page is one contiguous byte run. Everything that changes those bytes is part
of the spec and of its namespace digest; nothing about parallelism is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgpack

# Bumped whenever the byte layout of a page object changes; part of every
# namespace, so pages of an older layout are misses, never misread.
LAYOUT_VERSION = 1

# KV cache dtype name -> bytes per element. fp8 formats are stored and moved as
# raw bytes; the layout never interprets them.
KV_DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

ATTENTION_KINDS = ("mha", "mla")

DIGEST_BYTES = 32

# How page keys derive from tokens (`kvrelay.layout.keys`).
KEY_SCHEMES = ("kvrelay", "sglang")

# RoPE positions of an MTP draft slot t (computed from the target's hidden
# state at t and token t + 1): "target" uses t (SGLang, vLLM), "shifted" t + 1
# (transformers' generic MtpModel).
DRAFT_POSITION_CONVENTIONS = ("target", "shifted")


class LayoutError(ValueError):
    """A spec, parallel config or rectangle that cannot describe a valid layout."""


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")


# Tokens per page wherever a page size is not given (configs, flags, specs).
DEFAULT_PAGE_SIZE = 64


@dataclass(frozen=True, slots=True)
class ModelKVSpec:
    """Identity and geometry of one model's KV cache pages.

    `num_kv_heads` is the model's global KV head count (GQA: fewer than the
    query heads). MLA models have one latent "head" whose block holds the latent
    and rope parts concatenated in `k_head_dim`, and no V (`v_head_dim == 0`).
    A draft (MTP) model's spec carries `target_namespace`, the namespace of the
    target it drafts for, since its KV depends on the target's hidden states.
    """

    model_id: str
    weights_fingerprint: str
    num_layers: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    kv_dtype: str
    attention_kind: str = "mha"
    page_size: int = DEFAULT_PAGE_SIZE
    salt: str = ""
    target_namespace: bytes | None = None
    # A draft's RoPE position convention ("target": draft slot t at position
    # t; "shifted": at t + 1). It changes the draft's K bytes.
    draft_positions: str | None = None
    # How page keys derive from token ids (`kvrelay.layout.keys`): "kvrelay",
    # or "sglang" to share pages with SGLang through its HiCache adapter.
    key_scheme: str = "kvrelay"
    # MLA: the trailing RoPE part of the latent row (k_head_dim = compressed
    # KV width + rope_head_dim). Named in the namespace, not in the bytes.
    rope_head_dim: int = 0
    # DeepSeek sparse attention: the layers whose indexer runs carry its key
    # per token after their latent rows, `index_head_dim` wide in
    # `index_dtype`; `index_topk` changes every later layer's bytes.
    index_head_dim: int = 0
    index_dtype: str | None = None
    index_layers: tuple[int, ...] = ()
    index_topk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise LayoutError("model_id must be a non-empty string")
        if not isinstance(self.weights_fingerprint, str):
            raise LayoutError("weights_fingerprint must be a string")
        if not isinstance(self.salt, str):
            raise LayoutError("salt must be a string")
        for name in ("num_layers", "num_kv_heads", "k_head_dim", "page_size"):
            _positive(name, getattr(self, name))
        if self.kv_dtype not in KV_DTYPE_ITEMSIZE:
            raise LayoutError(
                f"kv_dtype {self.kv_dtype!r} is not one of {sorted(KV_DTYPE_ITEMSIZE)}"
            )
        if self.attention_kind not in ATTENTION_KINDS:
            raise LayoutError(f"attention_kind must be one of {ATTENTION_KINDS}")
        if self.attention_kind == "mla":
            if self.num_kv_heads != 1 or self.v_head_dim != 0:
                raise LayoutError("an MLA spec has num_kv_heads == 1 and v_head_dim == 0")
        else:
            _positive("v_head_dim", self.v_head_dim)
        if self.target_namespace is not None and (
            not isinstance(self.target_namespace, bytes)
            or len(self.target_namespace) != DIGEST_BYTES
        ):
            raise LayoutError("target_namespace must be a 32-byte digest")
        if (self.draft_positions is None) != (self.target_namespace is None):
            raise LayoutError("a draft spec has both target_namespace and draft_positions")
        if self.key_scheme not in KEY_SCHEMES:
            raise LayoutError(f"key_scheme must be one of {KEY_SCHEMES}, got {self.key_scheme!r}")
        if self.draft_positions not in (None, *DRAFT_POSITION_CONVENTIONS):
            raise LayoutError(f"draft_positions must be one of {DRAFT_POSITION_CONVENTIONS}")
        self._check_sparse_fields()

    def _check_sparse_fields(self) -> None:
        for name in ("rope_head_dim", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{name} must be a non-negative int, got {value!r}")
        if self.rope_head_dim and (
            self.attention_kind != "mla" or self.rope_head_dim >= self.k_head_dim
        ):
            raise LayoutError("rope_head_dim is the RoPE part of an MLA latent row")
        layers = self.index_layers
        if not isinstance(layers, tuple) or any(
            not isinstance(layer, int) or isinstance(layer, bool) for layer in layers
        ):
            raise LayoutError(f"index_layers must be a tuple of layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)) or (
            layers and not 0 <= layers[0] <= layers[-1] < self.num_layers
        ):
            raise LayoutError(
                f"index_layers {layers} must be increasing layer indices below {self.num_layers}"
            )
        indexed = bool(self.index_head_dim)
        if indexed != bool(layers) or indexed != bool(self.index_topk):
            raise LayoutError(
                "a sparse-attention spec has index_head_dim, index_layers and index_topk"
            )
        if indexed and self.attention_kind != "mla":
            raise LayoutError("indexer keys ride in MLA pages only")
        if self.index_dtype is not None:
            if not indexed:
                raise LayoutError("index_dtype without indexer layers")
            if self.index_dtype not in KV_DTYPE_ITEMSIZE:
                raise LayoutError(
                    f"index_dtype {self.index_dtype!r} is not one of {sorted(KV_DTYPE_ITEMSIZE)}"
                )

    # -- geometry ---------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return KV_DTYPE_ITEMSIZE[self.kv_dtype]

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's K (or MLA latent) for one head."""
        return self.k_head_dim * self.itemsize

    @property
    def v_row_bytes(self) -> int:
        return self.v_head_dim * self.itemsize

    @property
    def index_itemsize(self) -> int:
        return KV_DTYPE_ITEMSIZE[self.index_dtype or self.kv_dtype]

    @property
    def index_row_bytes(self) -> int:
        """Bytes of one token's indexer key (0 without an indexer)."""
        return self.index_head_dim * self.index_itemsize

    @property
    def uniform(self) -> bool:
        """Whether every (head, layer) block has the same size (no indexer layers)."""
        return not self.index_layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one (head, layer) block: all tokens' K then all tokens' V.
        Only a uniform spec has one block size (`layer_block_bytes` otherwise)."""
        if not self.uniform:
            raise LayoutError("blocks of a spec with indexer layers differ: use layer_block_bytes")
        return self.page_size * (self.k_row_bytes + self.v_row_bytes)

    def layer_block_bytes(self, layer: int) -> int:
        """Bytes of layer `layer`'s block of one head: the tokens' K (MLA: the
        latent rows), then V, then the indexer keys where that layer's indexer runs."""
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} outside the page's {self.num_layers}")
        extra = self.index_row_bytes if layer in self._index_set else 0
        return self.page_size * (self.k_row_bytes + self.v_row_bytes + extra)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of layer `layer`'s block inside one head's run of layers
        (`layer == num_layers` gives the run's length)."""
        if not 0 <= layer <= self.num_layers:
            raise LayoutError(f"layer {layer} outside the page's {self.num_layers}")
        plain = self.page_size * (self.k_row_bytes + self.v_row_bytes)
        indexed = sum(1 for index_layer in self.index_layers if index_layer < layer)
        return layer * plain + indexed * self.page_size * self.index_row_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's blocks of every layer."""
        return self.layer_offset(self.num_layers)

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    def block_offset(self, head: int, layer: int) -> int:
        """Byte offset of block (head, layer) inside a page object."""
        if not (0 <= head < self.num_kv_heads and 0 <= layer < self.num_layers):
            raise LayoutError(f"block ({head}, {layer}) outside the page")
        return head * self.head_bytes + self.layer_offset(layer)

    @property
    def _index_set(self) -> frozenset[int]:
        return frozenset(self.index_layers)

    # -- identity ---------------------------------------------------------
    def identity_fields(self) -> dict[str, object]:
        """The fields hashed into the namespace, in a fixed order."""
        fields: dict[str, object] = {
            "layout_version": LAYOUT_VERSION,
            "model_id": self.model_id,
            "weights_fingerprint": self.weights_fingerprint,
            "kv_dtype": self.kv_dtype,
            "page_size": self.page_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "k_head_dim": self.k_head_dim,
            "v_head_dim": self.v_head_dim,
            "attention_kind": self.attention_kind,
            "salt": self.salt,
        }
        if self.target_namespace is not None:
            fields["target_namespace"] = self.target_namespace
            fields["draft_positions"] = self.draft_positions
        if self.key_scheme != "kvrelay":  # absent by default: namespaces stay as they were
            fields["key_scheme"] = self.key_scheme
        if self.rope_head_dim:
            fields["rope_head_dim"] = self.rope_head_dim
        if self.index_layers:
            fields["index_head_dim"] = self.index_head_dim
            fields["index_dtype"] = self.index_dtype or self.kv_dtype
            fields["index_layers"] = list(self.index_layers)
            fields["index_topk"] = self.index_topk
        return fields

    def namespace(self) -> bytes:
        """sha256 of the msgpack of the identity fields: the root of every key chain."""
        packed = msgpack.packb(self.identity_fields(), use_bin_type=True)
        return hashlib.sha256(packed).digest()

    def page_keys(self, tokens, parent: bytes | None = None) -> list[bytes]:
        """Keys of the full pages of `tokens` under the spec's key scheme
        (`kvrelay.layout.keys`); `parent` (the kvrelay scheme only) is the key
        of the page before `tokens[0]`. A draft's pages are keyed by
        `kvrelay.layout.draft.draft_page_keys`."""
        from kvrelay.layout.keys import page_keys

        if self.target_namespace is not None:
            raise LayoutError("a draft page's key covers the next token: use draft_page_keys")
        if parent is None:
            return self.key_chain(tokens).keys
        if self.key_scheme != "kvrelay":
            raise LayoutError(
                "an sglang-scheme chain is extended through key_chain, not a parent key"
            )
        return page_keys(parent, tokens, self.page_size)

    def key_chain(self, tokens=()):
        """A `PageKeyChain` holding the keys of the full pages of `tokens`, to
        be extended as the sequence grows."""
        from kvrelay.layout.keys import PageKeyChain

        chain = PageKeyChain(self.key_scheme, self.namespace(), self.page_size)
        chain.extend(tokens)
        return chain

    def draft_spec(
        self,
        *,
        model_id: str,
        weights_fingerprint: str,
        num_layers: int,
        num_kv_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        kv_dtype: str | None = None,
        attention_kind: str = "mha",
        positions: str = "target",
        rope_head_dim: int = 0,
        index_head_dim: int = 0,
        index_dtype: str | None = None,
        index_layers: tuple[int, ...] = (),
        index_topk: int = 0,
    ) -> ModelKVSpec:
        """Spec of a draft (MTP) model whose pages ride beside this target's.

        Page size and tenant salt are the target's; the namespace derives from
        the target's and the draft's RoPE position convention. Draft page p is
        keyed by the target's key of page p and the first token of page p + 1
        (`kvrelay.layout.draft.draft_page_keys`), since its last slot depends
        on that token. An MLA draft (an MTP layer of a DeepSeek-shaped model)
        carries its latent rows, and its indexer keys where its indexer runs.
        """
        return ModelKVSpec(
            model_id=model_id,
            weights_fingerprint=weights_fingerprint,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            k_head_dim=k_head_dim,
            v_head_dim=v_head_dim,
            kv_dtype=self.kv_dtype if kv_dtype is None else kv_dtype,
            attention_kind=attention_kind,
            page_size=self.page_size,
            salt=self.salt,
            target_namespace=self.namespace(),
            draft_positions=positions,
            rope_head_dim=rope_head_dim,
            index_head_dim=index_head_dim,
            index_dtype=index_dtype,
            index_layers=index_layers,
            index_topk=index_topk,
        )
