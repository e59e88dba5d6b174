// CPU gather/scatter between an engine's paged KV pool and unified page
// objects. Pages are split over `cpu_threads` threads; within a page each
// layer is moved token by token (see copy_layer_rows in page_copy_cpu_rows.inc),
// K rows then V rows, or, gathering from a pool whose slot holds every layer
// of its token, token by token over every layer (copy_page_tokens); by the
// AVX2 build of the loops where the CPU has it.
#include <algorithm>
#include <atomic>
#include <memory>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "page_copy.h"

namespace kvrelay {
namespace {

// How far ahead of the copied token gather looks for a jump in the slots, and
// how many tokens of the new run it prefetches there (about 4 KiB ahead and
// two tokens' rows for the common pools; measured on Zen 4 and older x86).
constexpr int64_t kPrefetchTokens = 8;
constexpr int64_t kPrefetchRunTokens = 2;

#if defined(__SSE2__)
constexpr bool kHaveStreaming = true;
#else
constexpr bool kHaveStreaming = false;
#endif

namespace baseline {
#if defined(__SSE2__)
#define KVRELAY_STREAM_BYTES 16
#else
#define KVRELAY_STREAM_BYTES 0
#endif
#include "page_copy_cpu_rows.inc"
#undef KVRELAY_STREAM_BYTES
}  // namespace baseline

// The same loops built for AVX2, taken when the CPU has it: 32-byte
// streaming stores and loads move a row in half the instructions, which
// brings gather from 0.93x to about 1.0x of memcpy on a full page here.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVRELAY_HAVE_AVX2_LOOPS 1
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
#define KVRELAY_STREAM_BYTES 32
#include "page_copy_cpu_rows.inc"
#undef KVRELAY_STREAM_BYTES
}  // namespace avx2
#pragma GCC pop_options
#endif

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

// AVX2 where the CPU has it, unless KVRELAY_PAGE_COPY_LOOPS=baseline asks
// for the plain loops (how the tests run both builds on one machine).
bool use_avx2_loops() {
#if defined(KVRELAY_HAVE_AVX2_LOOPS)
  static const bool avx2 = [] {
    const char* forced = std::getenv("KVRELAY_PAGE_COPY_LOOPS");
    if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return false;
    return static_cast<bool>(__builtin_cpu_supports("avx2"));
  }();
  return avx2;
#else
  return false;
#endif
}

// Whether every layer's rows of a token lie within its slot (SGLang's
// page_first pools): then gather moves pages token by token.
bool layers_in_slot(const PageCopyParams& p) {
  if (p.num_layers < 2) return false;
  for (int64_t l = 1; l < p.num_layers; ++l) {
    const int64_t k_gap = p.k_layers[l] - p.k_layers[l - 1];
    if (k_gap <= 0 || k_gap >= p.k_slot_stride) return false;
    if (p.v_row_bytes == 0) continue;
    const int64_t v_gap = p.v_layers[l] - p.v_layers[l - 1];
    if (v_gap <= 0 || v_gap >= p.v_slot_stride) return false;
  }
  return true;
}

// `tokens`: token by token over every layer (`layers_in_slot`, gather only).
template <bool kGather>
void copy_page_range(const PageCopyParams& p, int64_t begin, int64_t end, bool stream,
                     bool tokens) {
#if defined(KVRELAY_HAVE_AVX2_LOOPS)
  if (use_avx2_loops()) {
    if (tokens) return avx2::copy_page_range_tokens<kGather>(p, begin, end, stream);
    return avx2::copy_page_range<kGather>(p, begin, end, stream);
  }
#endif
  if (tokens) return baseline::copy_page_range_tokens<kGather>(p, begin, end, stream);
  baseline::copy_page_range<kGather>(p, begin, end, stream);
}

template <bool kGather>
void copy_pages(const PageCopyParams& p) {
  if (p.num_pages == 0 || p.num_layers == 0 || p.num_heads == 0) return;
  const bool stream = can_stream(p, kGather);
  const bool tokens = kGather && layers_in_slot(p);
  const int64_t threads = std::max<int64_t>(1, std::min(p.cpu_threads, p.num_pages));
  if (threads == 1) {
    copy_page_range<kGather>(p, 0, p.num_pages, stream, tokens);
    return;
  }
  // Pages go out in chunks through a shared counter, the caller's thread
  // taking chunks too, and the caller waits only for chunks a worker took.
  // A worker the OS has not run yet (the other core busy: a server, another
  // thread) then takes none and is not waited for: joining it cost up to a
  // scheduler tick (4 ms) on a 2-vCPU VM, for a copy of 1 ms. Workers are
  // detached; the state they share outlives the call, and one that starts
  // after the copy finds no chunk and touches nothing of the caller's.
  struct Shared {
    PageCopyParams params;
    bool stream, tokens;
    int64_t chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->params = p;
  shared->stream = stream;
  shared->tokens = tokens;
  shared->chunk = std::max<int64_t>(1, p.num_pages / (threads * 4));
  shared->chunks = (p.num_pages + shared->chunk - 1) / shared->chunk;
  auto work = [](Shared& s) {
    for (int64_t c = s.next.fetch_add(1); c < s.chunks; c = s.next.fetch_add(1)) {
      const int64_t begin = c * s.chunk;
      copy_page_range<kGather>(s.params, begin, std::min(begin + s.chunk, s.params.num_pages),
                               s.stream, s.tokens);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 1; w < threads; ++w) std::thread([shared, work] { work(*shared); }).detach();
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) std::this_thread::yield();
}

}  // namespace

void gather_pages_cpu(const PageCopyParams& p) { copy_pages<true>(p); }
const char* cpu_page_copy_loops() { return use_avx2_loops() ? "avx2" : "baseline"; }
void scatter_pages_cpu(const PageCopyParams& p) { copy_pages<false>(p); }

}  // namespace kvrelay
