// kvrelay.transfer._runcopy: copy a batch of byte runs between two mapped
// regions in one call, with the GIL released once for the whole batch.
//
// copy_runs(dst_base, src_base, triples, threads, stream_min_bytes) -> None
//   triples: a C-contiguous buffer of uint64 (dst offset, src offset, length)
//   rows, already bounds-checked by the caller against both regions.
//
// The same-host fast path used ctypes.memmove per run: one GIL round trip per
// 64 KiB run, and plain stores, which read every destination line before
// writing it. Here `threads` std::threads share the rows (runs over 1 MiB
// are cut into 1 MiB pieces) through a counter, and when the batch moves at least
// `stream_min_bytes` the copies use non-temporal stores where the
// destination is 16-byte aligned: a pull's bytes are not read again before
// they are scattered, so caching them only evicts other data.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVRELAY_HAVE_STREAM 1
#else
#define KVRELAY_HAVE_STREAM 0
#endif

namespace {

struct Piece {
  uint8_t* dst;
  const uint8_t* src;
  uint64_t len;
};

void stream_copy(uint8_t* dst, const uint8_t* src, uint64_t len) {
#if KVRELAY_HAVE_STREAM
  // Head up to 16-byte alignment of dst with plain stores, then 64 bytes a step.
  const uint64_t head = std::min<uint64_t>(len, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  len -= head;
  uint64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, len - i);
#else
  std::memmove(dst, src, len);
#endif
}

// Copies pieces taken from a shared counter until none is left. Threads
// take work as they come: a static split left the whole batch waiting for a
// thread that started late on a busy machine (a 16 MiB pull ran at half of
// memcpy's speed on two cores while another process ran).
void copy_pieces(const std::vector<Piece>& pieces, std::atomic<size_t>& next, bool stream) {
  for (size_t k = next.fetch_add(1); k < pieces.size(); k = next.fetch_add(1)) {
    const Piece& p = pieces[k];
    if (stream) {
      stream_copy(p.dst, p.src, p.len);
    } else {
      std::memmove(p.dst, p.src, p.len);
    }
  }
#if KVRELAY_HAVE_STREAM
  if (stream) _mm_sfence();  // streaming stores are weakly ordered
#endif
}

// Cuts runs longer than `chunk` so that threads can share a long run.
std::vector<Piece> cut(const std::vector<Piece>& pieces, uint64_t chunk) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece p : pieces) {
    while (p.len > chunk) {
      out.push_back({p.dst, p.src, chunk});
      p.dst += chunk;
      p.src += chunk;
      p.len -= chunk;
    }
    out.push_back(p);
  }
  return out;
}

constexpr uint64_t kChunkBytes = 1 << 20;

PyObject* copy_runs(PyObject*, PyObject* args) {
  unsigned long long dst_base = 0, src_base = 0, stream_min = 0;
  Py_buffer view;
  int threads = 1;
  if (!PyArg_ParseTuple(args, "KKy*iK", &dst_base, &src_base, &view, &threads, &stream_min)) {
    return nullptr;
  }
  if (view.len % (3 * sizeof(uint64_t)) != 0 || threads < 1) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "triples must be uint64 rows of 3; threads >= 1");
    return nullptr;
  }
  const size_t rows = view.len / (3 * sizeof(uint64_t));
  std::vector<Piece> pieces;
  pieces.reserve(rows);
  uint64_t total = 0;
  const auto* t = static_cast<const uint64_t*>(view.buf);
  for (size_t r = 0; r < rows; ++r) {
    const uint64_t len = t[3 * r + 2];
    if (len == 0) continue;
    pieces.push_back({reinterpret_cast<uint8_t*>(dst_base + t[3 * r]),
                      reinterpret_cast<const uint8_t*>(src_base + t[3 * r + 1]), len});
    total += len;
  }
  PyBuffer_Release(&view);
  const bool stream = total >= stream_min;
  Py_BEGIN_ALLOW_THREADS;
  std::atomic<size_t> next{0};
  if (threads == 1) {
    copy_pieces(pieces, next, stream);
  } else {
    const std::vector<Piece> chunks = cut(pieces, kChunkBytes);
    const size_t helpers = std::min<size_t>(threads, chunks.size()) - 1;
    std::vector<std::thread> workers;
    for (size_t w = 0; w < helpers; ++w) {
      workers.emplace_back(copy_pieces, std::cref(chunks), std::ref(next), stream);
    }
    copy_pieces(chunks, next, stream);
    for (auto& w : workers) w.join();
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dst_base, src_base, triples, threads, stream_min_bytes): copy uint64 "
     "(dst offset, src offset, length) rows; bounds are the caller's job"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_runcopy", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__runcopy() { return PyModule_Create(&module); }
