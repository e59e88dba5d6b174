// CPU gather/scatter between an engine's paged KV pool and unified page
// objects. Pages are split over `cpu_threads` threads; within a page each
// layer is moved token by token (see copy_layer_rows), K rows then V rows.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "page_copy.h"

namespace kvrelay {
namespace {

// Rows of the common sizes are copied with a compile-time length, which the
// compiler turns into a few vector moves instead of a libc call per row.
template <int64_t kRow>
inline void copy_row(uint8_t* dst, const uint8_t* src, int64_t row) {
  std::memcpy(dst, src, kRow == 0 ? row : kRow);
}

#if defined(__SSE2__)
// Non-temporal 16-byte stores; the caller checked 16-byte alignment of every
// destination row and of the row length.
template <int64_t kRow>
inline void stream_row(uint8_t* dst, const uint8_t* src, int64_t row) {
  const int64_t n = kRow == 0 ? row : kRow;
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), v);
  }
}
constexpr bool kHaveStreaming = true;
#else
template <int64_t kRow>
inline void stream_row(uint8_t* dst, const uint8_t* src, int64_t row) {
  copy_row<kRow>(dst, src, row);
}
constexpr bool kHaveStreaming = false;
#endif

constexpr int64_t kPrefetchTokens = 4;

// One layer of one page for one tensor (K or V): page_size tokens x num_heads
// rows. Token-major, so each token's heads are read (gather) or written
// (scatter) as one sequential run of the pool, while the page side advances
// num_heads sequential streams, one per (head, layer) block.
// kGather: pool rows -> page rows; otherwise the reverse.
template <bool kGather, bool kStream, int64_t kRow>
void copy_layer_rows(uint8_t* page_rows, int64_t head_block_step, uint8_t* pool_base,
                     int64_t head_stride, int64_t slot_stride, const int64_t* slots,
                     int64_t page_size, int64_t num_heads, int64_t row) {
  // Gather reads the pool, which jumps at every engine page boundary, where
  // the hardware prefetcher loses the stream: fetch the pool rows of a token a
  // few steps ahead (its heads are usually one contiguous span). Scatter
  // writes the pool, often with streaming stores: prefetching there would
  // pull the destination into cache for nothing.
  const int64_t span = (num_heads - 1) * head_stride + row;
  for (int64_t t = 0; t < page_size; ++t) {
    if (kGather && t + kPrefetchTokens < page_size && slots[t + kPrefetchTokens] >= 0) {
      const uint8_t* ahead = pool_base + slots[t + kPrefetchTokens] * slot_stride;
      for (int64_t off = 0; off < span; off += 64) __builtin_prefetch(ahead + off, 0);
    }
    const int64_t slot = slots[t];
    uint8_t* page_row = page_rows + t * row;
    if (slot < 0) {
      if (kGather) {
        for (int64_t j = 0; j < num_heads; ++j) std::memset(page_row + j * head_block_step, 0, row);
      }
      continue;
    }
    uint8_t* pool_row = pool_base + slot * slot_stride;
    for (int64_t j = 0; j < num_heads; ++j) {
      uint8_t* a = page_row + j * head_block_step;
      uint8_t* b = pool_row + j * head_stride;
      uint8_t* dst = kGather ? a : b;
      const uint8_t* src = kGather ? b : a;
      if (kStream) {
        stream_row<kRow>(dst, src, row);
      } else {
        copy_row<kRow>(dst, src, row);
      }
    }
  }
}

using RowCopier = void (*)(uint8_t*, int64_t, uint8_t*, int64_t, int64_t, const int64_t*, int64_t,
                          int64_t, int64_t);

template <bool kGather, bool kStream>
RowCopier pick_for_size(int64_t row) {
  switch (row) {
    case 64: return copy_layer_rows<kGather, kStream, 64>;
    case 128: return copy_layer_rows<kGather, kStream, 128>;
    case 256: return copy_layer_rows<kGather, kStream, 256>;
    case 512: return copy_layer_rows<kGather, kStream, 512>;
    case 576: return copy_layer_rows<kGather, kStream, 576>;    // MLA latent+rope, 1 byte
    case 1152: return copy_layer_rows<kGather, kStream, 1152>;  // MLA latent+rope, bf16
    default: return copy_layer_rows<kGather, kStream, 0>;
  }
}

template <bool kGather>
RowCopier pick_copier(int64_t row, bool stream) {
  return stream ? pick_for_size<kGather, true>(row) : pick_for_size<kGather, false>(row);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Streaming stores need every destination row 16-byte aligned: the page side
// (gather) or the pool side (scatter).
bool can_stream(const PageCopyParams& p, bool gather) {
  if (!kHaveStreaming || !p.streaming_stores) return false;
  if (p.k_row_bytes % 16 || p.v_row_bytes % 16) return false;
  if (gather) return aligned16(p.pages) && p.page_stride % 16 == 0;
  if (p.k_slot_stride % 16 || p.k_head_stride % 16) return false;
  if (p.v_row_bytes && (p.v_slot_stride % 16 || p.v_head_stride % 16)) return false;
  for (int64_t l = 0; l < p.num_layers; ++l) {
    if (!aligned16(p.k_layers[l])) return false;
    if (p.v_row_bytes && !aligned16(p.v_layers[l])) return false;
  }
  return true;
}

template <bool kGather>
void copy_page_range(const PageCopyParams& p, int64_t begin, int64_t end, bool stream) {
  const RowCopier copy_k = pick_copier<kGather>(p.k_row_bytes, stream);
  const RowCopier copy_v = pick_copier<kGather>(p.v_row_bytes, stream);
  const int64_t k_part = p.page_size * p.k_row_bytes;
  const int64_t head_block_step = p.page_layers * p.page_size * (p.k_row_bytes + p.v_row_bytes);
  for (int64_t i = begin; i < end; ++i) {
    uint8_t* page = p.pages + p.page_ids[i] * p.page_stride;
    const int64_t* slots = p.slot_mapping + i * p.page_size;
    for (int64_t l = 0; l < p.num_layers; ++l) {
      uint8_t* block = page + block_offset(p, p.page_head_start, p.page_layer_start + l);
      copy_k(block, head_block_step, p.k_layers[l] + p.pool_head_start * p.k_head_stride,
             p.k_head_stride, p.k_slot_stride, slots, p.page_size, p.num_heads, p.k_row_bytes);
      if (p.v_row_bytes > 0) {
        copy_v(block + k_part, head_block_step,
               p.v_layers[l] + p.pool_head_start * p.v_head_stride, p.v_head_stride,
               p.v_slot_stride, slots, p.page_size, p.num_heads, p.v_row_bytes);
      }
    }
  }
#if defined(__SSE2__)
  // Non-temporal stores are weakly ordered: fence before another thread (or
  // the caller, after join) may read the destination.
  if (stream) _mm_sfence();
#endif
}

template <bool kGather>
void copy_pages(const PageCopyParams& p) {
  if (p.num_pages == 0 || p.num_layers == 0 || p.num_heads == 0) return;
  const bool stream = can_stream(p, kGather);
  const int64_t threads = std::max<int64_t>(1, std::min(p.cpu_threads, p.num_pages));
  if (threads == 1) {
    copy_page_range<kGather>(p, 0, p.num_pages, stream);
    return;
  }
  // Contiguous page ranges per thread; the caller's thread takes the first.
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  const int64_t per = p.num_pages / threads, extra = p.num_pages % threads;
  int64_t begin = 0;
  std::pair<int64_t, int64_t> mine{0, 0};
  for (int64_t w = 0; w < threads; ++w) {
    const int64_t end = begin + per + (w < extra ? 1 : 0);
    if (w == 0) {
      mine = {begin, end};
    } else {
      workers.emplace_back([&p, begin, end, stream] { copy_page_range<kGather>(p, begin, end, stream); });
    }
    begin = end;
  }
  copy_page_range<kGather>(p, mine.first, mine.second, stream);
  for (auto& w : workers) w.join();
}

}  // namespace

void gather_pages_cpu(const PageCopyParams& p) { copy_pages<true>(p); }
void scatter_pages_cpu(const PageCopyParams& p) { copy_pages<false>(p); }

}  // namespace kvrelay
