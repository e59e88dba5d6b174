// Parameters shared by the CPU and CUDA implementations of gather_pages /
// scatter_pages. Kept free of torch headers so the CUDA file compiles with a
// bare `nvcc -c` (CI does this even where torch has no CUDA).
//
// The unified page object (DESIGN.md section 3) is
//   page[head][layer] = K[token][k_row] ++ V[token][v_row]   (bytes, C order)
// for a page object of `page_heads` x `page_layers` blocks. A call moves the
// rectangle heads [page_head_start, page_head_start + num_heads) x layers
// [page_layer_start, page_layer_start + num_layers) of every listed page,
// between the page objects and an engine's paged pool, whose per-layer K and V
// tensors are addressed as base + slot * slot_stride + head * head_stride.
#pragma once
#include <cstdint>

namespace kvrelay {

// Layers moved by one launch; the host side splits longer models into chunks
// so the pointer table travels by value in the kernel parameters (no device
// allocation, no host-device sync).
constexpr int kMaxLayersPerLaunch = 128;

struct PageCopyParams {
  // Per-layer pool base pointers for the layers of this launch (index 0 is
  // page layer page_layer_start). v_layers unused when v_row_bytes == 0 (MLA).
  uint8_t* k_layers[kMaxLayersPerLaunch];
  uint8_t* v_layers[kMaxLayersPerLaunch];
  int64_t num_layers;         // layers in this launch (<= kMaxLayersPerLaunch)

  // Engine pool geometry, in bytes.
  int64_t k_slot_stride;      // bytes between consecutive token slots of K
  int64_t k_head_stride;      // bytes between consecutive heads of K
  int64_t v_slot_stride;
  int64_t v_head_stride;
  int64_t k_row_bytes;        // k_head_dim * itemsize
  int64_t v_row_bytes;        // v_head_dim * itemsize, 0 for MLA
  int64_t pool_head_start;    // pool head holding the rectangle's first head

  // Request pages.
  int64_t num_pages;
  int64_t page_size;          // tokens per unified page
  const int64_t* page_ids;    // [num_pages]: row of each page in the arena
  const int64_t* slot_mapping;// [num_pages * page_size]: pool slot, -1 = none

  // Page arena and the page-object geometry.
  uint8_t* pages;             // arena base
  int64_t page_stride;        // bytes between arena rows
  int64_t page_heads;         // heads in a page object
  int64_t page_layers;        // layers in a page object
  int64_t page_head_start;    // rectangle's first head inside the page object
  int64_t page_layer_start;   // first layer of this launch inside the page object
  int64_t num_heads;          // heads in the rectangle

  // CPU only: threads to split the pages over, and whether to write the
  // destination with non-temporal stores (large copies, whose destination
  // will not be read again soon: it skips the read-for-ownership of every
  // destination line, a third of the memory traffic of a cached copy).
  int64_t cpu_threads;
  bool streaming_stores;
};

// Byte offset of block (head, layer) inside a page object.
inline int64_t block_offset(const PageCopyParams& p, int64_t head, int64_t layer) {
  const int64_t block_bytes = p.page_size * (p.k_row_bytes + p.v_row_bytes);
  return (head * p.page_layers + layer) * block_bytes;
}

// gather: pool -> pages. Tokens with slot -1 get zero bytes, so a partial
// page's bytes (and its checksum) do not depend on stale memory.
// scatter: pages -> pool. Tokens with slot -1 are skipped.
void gather_pages_cpu(const PageCopyParams& p);
void scatter_pages_cpu(const PageCopyParams& p);
// Which build of the CPU loops runs: "avx2" or "baseline" (plain x86-64).
const char* cpu_page_copy_loops();

#ifdef KVRELAY_WITH_CUDA
// Asynchronous on `stream` (a cudaStream_t passed as void* to keep this header
// free of CUDA includes). Pointers must be device pointers.
void gather_pages_cuda(const PageCopyParams& p, void* stream);
void scatter_pages_cuda(const PageCopyParams& p, void* stream);
#endif

}  // namespace kvrelay
