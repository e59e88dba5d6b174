// kvrelay.transfer._runcopy: copy a batch of byte runs between two mapped
// regions in one call, with the GIL released once for the whole batch.
//
// copy_runs(dst_base, src_base, triples, threads, stream_min_bytes) -> None
//   triples: a C-contiguous buffer of uint64 (dst offset, src offset, length)
//   rows, already bounds-checked by the caller against both regions.
//
// The same-host fast path used ctypes.memmove per run: one GIL round trip per
// 64 KiB run, and plain stores, which read every destination line before
// writing it. Here the rows are split into byte-equal shares over `threads`
// std::threads (long runs are cut), and when the batch moves at least
// `stream_min_bytes` the copies use non-temporal stores where the
// destination is 16-byte aligned: a pull's bytes are not read again before
// they are scattered, so caching them only evicts other data.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
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

void copy_share(const std::vector<Piece>& pieces, size_t begin, size_t end, bool stream) {
  for (size_t k = begin; k < end; ++k) {
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

// Cuts the rows into `parts` runs of pieces with about equal bytes each.
std::vector<size_t> split(std::vector<Piece>& pieces, uint64_t total, int parts) {
  const uint64_t share = (total + parts - 1) / parts;
  std::vector<Piece> cut;
  std::vector<size_t> bounds{0};
  uint64_t room = share;
  for (Piece p : pieces) {
    while (p.len > 0) {
      if (room == 0) {
        bounds.push_back(cut.size());
        room = share;
      }
      const uint64_t take = std::min(room, p.len);
      cut.push_back({p.dst, p.src, take});
      p.dst += take;
      p.src += take;
      p.len -= take;
      room -= take;
    }
  }
  bounds.push_back(cut.size());
  pieces.swap(cut);
  return bounds;
}

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
  const int parts = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(threads, total)));
  if (parts == 1) {
    copy_share(pieces, 0, pieces.size(), stream);
  } else {
    const std::vector<size_t> bounds = split(pieces, total, parts);
    std::vector<std::thread> workers;
    for (size_t s = 1; s + 1 < bounds.size(); ++s) {
      workers.emplace_back(copy_share, std::cref(pieces), bounds[s], bounds[s + 1], stream);
    }
    copy_share(pieces, bounds[0], bounds[1], stream);
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
