// CUDA gather/scatter between an engine's paged KV pool and unified page
// objects. Layout and semantics are specified in page_copy.h; this file only
// decides how the work is spread over the GPU.
//
// Grid: x = page (grid-stride), y = layer of the launch, z = head (grid-stride).
// One thread block therefore moves one (page, layer, head) block of
// page_size * (k_row_bytes + v_row_bytes) bytes. Within it the K (then V) rows
// are flattened into one index space of W-byte vectors, so consecutive threads
// touch consecutive bytes of a pool row (coalesced) and, on the page side, the
// whole K or V region is one contiguous run.
#include "page_copy.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvrelay {
namespace {

// ---- device code

template <int W> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<2> { using type = uint16_t; };
template <> struct VecOf<1> { using type = uint8_t; };

// Several independent loads are issued before any store so each thread keeps
// several memory requests in flight; with small per-(page, layer, head)
// blocks this, not thread count, is what keeps HBM busy.
constexpr int kUnroll = 4;
constexpr int kMaxThreads = 256;

// Moves one K or V region of a block: `n` vectors, `vecs_per_row` per token.
// `page_region` is the contiguous run of rows inside the page object;
// `pool_head` is the pool address of slot 0 for this layer and head.
template <int W, bool kGather>
__device__ __forceinline__ void copy_region(uint8_t* __restrict__ page_region,
                                            uint8_t* __restrict__ pool_head,
                                            int64_t slot_stride,
                                            const int64_t* __restrict__ slots,
                                            uint32_t vecs_per_row, uint32_t n) {
  using V = typename VecOf<W>::type;
  const uint32_t step = blockDim.x;
  for (uint32_t base = threadIdx.x; base < n; base += step * kUnroll) {
    V vals[kUnroll];
    V* pool_ptr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * step;
      pool_ptr[u] = nullptr;
      vals[u] = V{};
      if (idx < n) {
        // 32-bit divide: a block's region is far below 2^32 vectors (checked
        // on the host), and a 64-bit divide would dominate this loop.
        const uint32_t t = idx / vecs_per_row;
        const uint32_t c = idx - t * vecs_per_row;
        const int64_t s = __ldg(slots + t);
        // -1 means "no slot"; treating every negative as such keeps a bad
        // slot from ever writing outside the pool.
        if (s >= 0)
          pool_ptr[u] = reinterpret_cast<V*>(pool_head + s * slot_stride +
                                             static_cast<int64_t>(c) * W);
        if (kGather) {
          if (pool_ptr[u] != nullptr) vals[u] = *pool_ptr[u];
        } else {
          vals[u] = reinterpret_cast<const V*>(page_region)[idx];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t idx = base + u * step;
      if (idx >= n) continue;
      // Gather writes zeros for empty slots so a partial page's bytes (and
      // checksum) never depend on stale arena memory.
      if (kGather)
        reinterpret_cast<V*>(page_region)[idx] = vals[u];
      else if (pool_ptr[u] != nullptr)
        *pool_ptr[u] = vals[u];
    }
  }
}

// Params travel by value (about 2.2 KB of kernel parameter space) so the
// per-layer pointer table needs no device allocation or host-device copy.
template <int W, bool kGather>
__global__ void __launch_bounds__(kMaxThreads)
page_copy_kernel(const PageCopyParams p, uint32_t k_vecs, uint32_t v_vecs) {
  const int64_t layer = blockIdx.y;
  const int64_t block_bytes = p.page_size * (p.k_row_bytes + p.v_row_bytes);
  const int64_t page_layer = p.page_layer_start + layer;
  const uint32_t k_n = k_vecs * static_cast<uint32_t>(p.page_size);
  const uint32_t v_n = v_vecs * static_cast<uint32_t>(p.page_size);
  uint8_t* const k_layer = p.k_layers[layer];
  uint8_t* const v_layer = p.v_layers[layer];

  for (int64_t i = blockIdx.x; i < p.num_pages; i += gridDim.x) {
    uint8_t* const page = p.pages + __ldg(p.page_ids + i) * p.page_stride;
    const int64_t* const slots = p.slot_mapping + i * p.page_size;
    for (int64_t j = blockIdx.z; j < p.num_heads; j += gridDim.z) {
      uint8_t* const block =
          page + ((p.page_head_start + j) * p.page_layers + page_layer) * block_bytes;
      copy_region<W, kGather>(block,
                              k_layer + (p.pool_head_start + j) * p.k_head_stride,
                              p.k_slot_stride, slots, k_vecs, k_n);
      if (v_n != 0)  // MLA pools have no V tensor; v_layer may be garbage.
        copy_region<W, kGather>(block + p.page_size * p.k_row_bytes,
                                v_layer + (p.pool_head_start + j) * p.v_head_stride,
                                p.v_slot_stride, slots, v_vecs, v_n);
    }
  }
}

// ---- end of device code

static_assert(sizeof(PageCopyParams) + 2 * sizeof(uint32_t) <= 4096,
              "kernel parameters must fit the classic 4 KB limit");

// Widest vector every address the kernel forms is aligned to. Each such
// address is a sum of multiples of these values (block offsets are multiples
// of the row sizes), so their common power-of-two factor bounds it.
int vector_width(const PageCopyParams& p) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p.pages) |
                  static_cast<uint64_t>(p.page_stride) |
                  static_cast<uint64_t>(p.k_row_bytes) |
                  static_cast<uint64_t>(p.k_slot_stride) |
                  static_cast<uint64_t>(p.k_head_stride);
  const bool has_v = p.v_row_bytes != 0;
  if (has_v)
    bits |= static_cast<uint64_t>(p.v_row_bytes) | static_cast<uint64_t>(p.v_slot_stride) |
            static_cast<uint64_t>(p.v_head_stride);
  for (int64_t l = 0; l < p.num_layers; ++l) {
    bits |= reinterpret_cast<uintptr_t>(p.k_layers[l]);
    if (has_v) bits |= reinterpret_cast<uintptr_t>(p.v_layers[l]);
  }
  for (int w = 16; w > 1; w >>= 1)
    if ((bits & static_cast<uint64_t>(w - 1)) == 0) return w;
  return 1;
}

template <int W, bool kGather>
void launch(const PageCopyParams& p, cudaStream_t stream) {
  const int64_t k_vecs = p.k_row_bytes / W;
  const int64_t v_vecs = p.v_row_bytes / W;
  const int64_t max_region = p.page_size * std::max(k_vecs, v_vecs);
  if (max_region > static_cast<int64_t>(UINT32_MAX) - kMaxThreads * kUnroll)
    throw std::runtime_error("kvrelay page copy: page block too large for the CUDA kernel");

  // Size the block to the work of one (page, layer, head) block: one unrolled
  // pass where possible, but at least 64 threads so the per-SM block limit
  // does not cap occupancy.
  const int64_t want = (max_region + kUnroll - 1) / kUnroll;
  const int threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(64, (want + 31) / 32 * 32)));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(p.num_pages, INT32_MAX)),
                  static_cast<unsigned>(p.num_layers),
                  static_cast<unsigned>(std::min<int64_t>(p.num_heads, 65535)));
  page_copy_kernel<W, kGather><<<grid, threads, 0, stream>>>(
      p, static_cast<uint32_t>(k_vecs), static_cast<uint32_t>(v_vecs));
}

template <bool kGather>
void run(const PageCopyParams& p, void* stream, const char* name) {
  if (p.num_pages == 0 || p.num_layers == 0 || p.num_heads == 0) return;
  if (p.page_size == 0 || (p.k_row_bytes == 0 && p.v_row_bytes == 0)) return;
  if (p.num_layers > kMaxLayersPerLaunch)
    throw std::runtime_error(std::string(name) + ": more layers than kMaxLayersPerLaunch");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (vector_width(p)) {
    case 16: launch<16, kGather>(p, s); break;
    case 8: launch<8, kGather>(p, s); break;
    case 4: launch<4, kGather>(p, s); break;
    case 2: launch<2, kGather>(p, s); break;
    default: launch<1, kGather>(p, s); break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(name) + ": " + cudaGetErrorString(err));
}

}  // namespace

void gather_pages_cuda(const PageCopyParams& p, void* stream) {
  run<true>(p, stream, "gather_pages_cuda");
}

void scatter_pages_cuda(const PageCopyParams& p, void* stream) {
  run<false>(p, stream, "scatter_pages_cuda");
}

}  // namespace kvrelay
