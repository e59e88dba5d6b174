// CPU gather/scatter between an engine's paged KV pool and unified page
// objects. Parallel over pages (ATen's pool, so torch.set_num_threads
// governs it); within a page the destination of gather is written in order.
#include <ATen/Parallel.h>

#include <cstring>

#include "page_copy.h"

namespace kvrelay {
namespace {

// Rows of the common sizes are copied with a compile-time length, which the
// compiler turns into a few vector moves instead of a libc call per row.
template <int64_t kRow>
inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t /*row*/) {
  std::memcpy(dst, src, kRow);
}
template <>
inline void copy_row<0>(uint8_t* dst, const uint8_t* src, int64_t row) {
  std::memcpy(dst, src, row);
}

// One (page, head, layer) block: page_size rows of one tensor (K or V).
// kGather: pool rows -> contiguous block rows; otherwise the reverse.
template <bool kGather, int64_t kRow>
void copy_block_rows(uint8_t* block, const uint8_t* pool_base, int64_t slot_stride,
                     const int64_t* slots, int64_t page_size, int64_t row) {
  for (int64_t t = 0; t < page_size; ++t) {
    const int64_t slot = slots[t];
    uint8_t* block_row = block + t * row;
    if (slot < 0) {
      if (kGather) std::memset(block_row, 0, row);
      continue;
    }
    uint8_t* pool_row = const_cast<uint8_t*>(pool_base) + slot * slot_stride;
    if (kGather) {
      copy_row<kRow>(block_row, pool_row, row);
    } else {
      copy_row<kRow>(pool_row, block_row, row);
    }
  }
}

template <bool kGather>
using RowCopier = void (*)(uint8_t*, const uint8_t*, int64_t, const int64_t*, int64_t, int64_t);

template <bool kGather>
RowCopier<kGather> pick_copier(int64_t row) {
  switch (row) {
    case 32: return copy_block_rows<kGather, 32>;
    case 64: return copy_block_rows<kGather, 64>;
    case 128: return copy_block_rows<kGather, 128>;
    case 256: return copy_block_rows<kGather, 256>;
    case 512: return copy_block_rows<kGather, 512>;
    case 576: return copy_block_rows<kGather, 576>;    // MLA: 512 latent + 64 rope, 1 byte
    case 1024: return copy_block_rows<kGather, 1024>;
    case 1152: return copy_block_rows<kGather, 1152>;  // MLA in bf16
    default: return copy_block_rows<kGather, 0>;
  }
}

template <bool kGather>
void copy_pages(const PageCopyParams& p) {
  if (p.num_pages == 0 || p.num_layers == 0 || p.num_heads == 0) return;
  const RowCopier<kGather> copy_k = pick_copier<kGather>(p.k_row_bytes);
  const RowCopier<kGather> copy_v = pick_copier<kGather>(p.v_row_bytes);
  const int64_t k_part = p.page_size * p.k_row_bytes;
  at::parallel_for(0, p.num_pages, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint8_t* page = p.pages + p.page_ids[i] * p.page_stride;
      const int64_t* slots = p.slot_mapping + i * p.page_size;
      for (int64_t j = 0; j < p.num_heads; ++j) {
        const int64_t pool_head = p.pool_head_start + j;
        for (int64_t l = 0; l < p.num_layers; ++l) {
          uint8_t* block = page + block_offset(p, p.page_head_start + j, p.page_layer_start + l);
          copy_k(block, p.k_layers[l] + pool_head * p.k_head_stride, p.k_slot_stride, slots,
                 p.page_size, p.k_row_bytes);
          if (p.v_row_bytes > 0) {
            copy_v(block + k_part, p.v_layers[l] + pool_head * p.v_head_stride, p.v_slot_stride,
                   slots, p.page_size, p.v_row_bytes);
          }
        }
      }
    }
  });
}

}  // namespace

void gather_pages_cpu(const PageCopyParams& p) { copy_pages<true>(p); }
void scatter_pages_cpu(const PageCopyParams& p) { copy_pages<false>(p); }

}  // namespace kvrelay
