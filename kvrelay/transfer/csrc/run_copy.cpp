// kvrelay.transfer._runcopy: plan and copy a batch of byte runs between two
// mapped regions, each in one call (the copy with the GIL released once).
//
// plan_runs(remote_runs, local_offsets, remote_size, local_size) -> (rows, n)
//   bounds checks and coalescing of a pull's runs (see plan_runs below;
//   reference: kvrelay.transfer.handle.plan_runs_reference).
// copy_runs(dst_base, src_base, triples, threads, stream_min_bytes[, prefetch]) -> None
//   triples: a C-contiguous buffer of uint64 (dst offset, src offset, length)
//   rows, already bounds-checked by the caller against both regions
//   (reference: kvrelay.transfer.arena.copy_runs_reference).
// readv_runs(pid, local_base, remote_base, triples, threads, write) -> None
//   the same rows (local offset, remote offset, length) copied by the kernel
//   out of (write: into) process `pid` with process_vm_readv (writev), up to
//   1024 runs a call (reference: kvrelay.transfer.arena.readv_runs_reference).
//
// The same-host fast path used ctypes.memmove per run: one GIL round trip per
// 64 KiB run, and plain stores, which read every destination line before
// writing it. Here `threads` std::threads share the rows (runs over 1 MiB
// are cut into 1 MiB pieces) through a counter, and when the batch moves at
// least `stream_min_bytes` the copies use non-temporal stores where the
// destination is 16-byte aligned: a pull's bytes are not read again before
// they are scattered, so caching them only evicts other data.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/uio.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "slot_board_ops.h"

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

constexpr uint64_t kPrefetchAhead = 1024;

void stream_copy(uint8_t* dst, const uint8_t* src, uint64_t len, bool prefetch) {
#if KVRELAY_HAVE_STREAM
  // Head up to 16-byte alignment of dst with plain stores, then 64 bytes a step.
  const uint64_t head = std::min<uint64_t>(len, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  len -= head;
  uint64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    // The source too is read once: fetched non-temporally it does not evict
    // what the process works with (after a 32 MiB pull the interpreter ran
    // from a cold cache). A prefetch past the run's end never faults.
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(src + i + kPrefetchAhead), _MM_HINT_NTA);
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
void copy_pieces(const std::vector<Piece>& pieces, std::atomic<size_t>& next, bool stream,
                 bool prefetch) {
  for (size_t k = next.fetch_add(1); k < pieces.size(); k = next.fetch_add(1)) {
    const Piece& p = pieces[k];
    if (stream) {
      stream_copy(p.dst, p.src, p.len, prefetch);
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
  int threads = 1, prefetch = 1;
  if (!PyArg_ParseTuple(args, "KKy*iK|p", &dst_base, &src_base, &view, &threads, &stream_min,
                        &prefetch)) {
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
    copy_pieces(pieces, next, stream, prefetch);
  } else {
    const std::vector<Piece> chunks = cut(pieces, kChunkBytes);
    const size_t helpers = std::min<size_t>(threads, chunks.size()) - 1;
    std::vector<std::thread> workers;
    for (size_t w = 0; w < helpers; ++w) {
      workers.emplace_back(copy_pieces, std::cref(chunks), std::ref(next), stream,
                           static_cast<bool>(prefetch));
    }
    copy_pieces(chunks, next, stream, prefetch);
    for (auto& w : workers) w.join();
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// Up to this many runs per process_vm_readv call (Linux's UIO_MAXIOV).
constexpr size_t kIovMax = 1024;

struct VmJob {
  pid_t pid;
  bool write;
  std::vector<iovec> local, remote;
  size_t group = kIovMax;  // runs per call
};

// Moves groups of `job.group` runs taken from a shared counter; returns 0 or
// the errno of the first failure. A call moves fewer bytes than asked only
// when it failed part way (an unmapped page of the peer): that is an error.
int vm_groups(VmJob& job, std::atomic<size_t>& next, std::atomic<int>& failed) {
  const size_t n = job.local.size();
  for (size_t g = next.fetch_add(1); g * job.group < n && failed.load() == 0;
       g = next.fetch_add(1)) {
    const size_t at = g * job.group, count = std::min(job.group, n - at);
    size_t want = 0;
    for (size_t i = at; i < at + count; ++i) want += job.local[i].iov_len;
    const ssize_t moved =
        job.write ? process_vm_writev(job.pid, &job.local[at], count, &job.remote[at], count, 0)
                  : process_vm_readv(job.pid, &job.local[at], count, &job.remote[at], count, 0);
    if (moved < 0 || static_cast<size_t>(moved) != want) {
      int expected = 0;
      failed.compare_exchange_strong(expected, moved < 0 ? errno : EFAULT);
    }
  }
  return failed.load();
}

PyObject* readv_runs(PyObject*, PyObject* args) {
  long pid = 0;
  unsigned long long local_base = 0, remote_base = 0;
  Py_buffer view;
  int threads = 1, write = 0;
  if (!PyArg_ParseTuple(args, "lKKy*ip", &pid, &local_base, &remote_base, &view, &threads,
                        &write)) {
    return nullptr;
  }
  if (view.len % (3 * sizeof(uint64_t)) != 0 || threads < 1 || pid <= 0) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "triples must be uint64 rows of 3; threads >= 1; pid > 0");
    return nullptr;
  }
  VmJob job{static_cast<pid_t>(pid), write != 0, {}, {}, kIovMax};
  const size_t rows = view.len / (3 * sizeof(uint64_t));
  const auto* t = static_cast<const uint64_t*>(view.buf);
  // With several threads, runs over 1 MiB are cut so that threads share them.
  const uint64_t chunk = threads > 1 ? kChunkBytes : UINT64_MAX;
  for (size_t r = 0; r < rows; ++r) {
    uint64_t local = local_base + t[3 * r], remote = remote_base + t[3 * r + 1];
    for (uint64_t left = t[3 * r + 2]; left > 0;) {
      const uint64_t len = std::min(left, chunk);
      job.local.push_back({reinterpret_cast<void*>(local), len});
      job.remote.push_back({reinterpret_cast<void*>(remote), len});
      local += len;
      remote += len;
      left -= len;
    }
  }
  PyBuffer_Release(&view);
  // Threads take groups of runs from a shared counter; a group is at most
  // kIovMax runs and small enough that every thread gets one.
  const size_t n = job.local.size();
  job.group = std::max<size_t>(1, std::min(kIovMax, (n + threads - 1) / threads));
  const size_t groups = (n + job.group - 1) / job.group;
  int err = 0;
  Py_BEGIN_ALLOW_THREADS;
  std::atomic<size_t> next{0};
  std::atomic<int> failed{0};
  std::vector<std::thread> workers;
  for (size_t w = 1; w < std::min<size_t>(threads, groups); ++w) {
    workers.emplace_back([&job, &next, &failed] { vm_groups(job, next, failed); });
  }
  vm_groups(job, next, failed);
  for (auto& w : workers) w.join();
  err = failed.load();
  Py_END_ALLOW_THREADS;
  if (err != 0) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  Py_RETURN_NONE;
}

// The class plan_runs raises for a run outside its region (IndexError until
// kvrelay.transfer.arena registers RunOutOfBounds).
PyObject* bounds_error = nullptr;

bool outside(uint64_t offset, uint64_t length, uint64_t size) {
  return length == 0 || offset > size || length > size - offset;
}

PyObject* raise_outside(const char* side, size_t i, uint64_t offset, uint64_t length,
                        uint64_t size) {
  PyErr_Format(bounds_error ? bounds_error : PyExc_IndexError,
               "%s run %zu (%llu, %llu) is outside [0, %llu) or empty", side, i,
               static_cast<unsigned long long>(offset), static_cast<unsigned long long>(length),
               static_cast<unsigned long long>(size));
  return nullptr;
}

// Local offsets as uint64: a buffer of 8-byte unsigned items, or a sequence
// of ints (a negative or a non-integer raises).
bool read_offsets(PyObject* obj, std::vector<uint64_t>& out) {
  if (PyObject_CheckBuffer(obj)) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return false;
    const char* f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    const bool u64 = view.itemsize == 8 && (std::strcmp(f, "Q") == 0 || std::strcmp(f, "L") == 0);
    if (u64) {
      const auto* p = static_cast<const uint64_t*>(view.buf);
      out.assign(p, p + view.len / 8);
    }
    PyBuffer_Release(&view);
    if (u64) return true;
  }
  PyObject* seq = PySequence_Fast(obj, "local offsets must be a sequence of ints");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out.resize(n);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_Check(items[i])) {
      PyErr_SetString(PyExc_TypeError, "local offsets must be ints");
      Py_DECREF(seq);
      return false;
    }
    out[i] = PyLong_AsUnsignedLongLong(items[i]);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_OverflowError, "local offset %R is not an unsigned 64-bit integer",
                   items[i]);
      Py_DECREF(seq);
      return false;
    }
  }
  Py_DECREF(seq);
  return true;
}

// plan_runs(remote_runs, local_offsets, remote_size, local_size) -> (rows, nbytes)
//   remote_runs: a buffer of uint64 (offset, length) pairs; local_offsets: one
//   uint64 per run. Checks every remote run against the remote region, merges
//   runs that continue each other on both sides, checks every merged row
//   against the local region, and returns the rows (remote offset, local
//   offset, length) as a bytearray of uint64 and their byte count. One call
//   instead of a dozen numpy passes: on a pull of a 512-run batch those cost
//   a tenth of the copy (the interpreter works from a cold cache after it).
PyObject* plan_runs(PyObject*, PyObject* args) {
  Py_buffer remote;
  PyObject* local_obj = nullptr;
  unsigned long long remote_size = 0, local_size = 0;
  if (!PyArg_ParseTuple(args, "y*OKK", &remote, &local_obj, &remote_size, &local_size)) {
    return nullptr;
  }
  std::vector<uint64_t> runs;
  if (remote.len % 16 == 0) {
    const auto* p = static_cast<const uint64_t*>(remote.buf);
    runs.assign(p, p + remote.len / 8);
  }
  const Py_ssize_t remote_len = remote.len;
  PyBuffer_Release(&remote);
  if (remote_len % 16 != 0) {
    PyErr_SetString(PyExc_ValueError, "remote runs must be uint64 (offset, length) pairs");
    return nullptr;
  }
  const size_t n = runs.size() / 2;
  std::vector<uint64_t> local;
  if (!read_offsets(local_obj, local)) return nullptr;
  if (local.size() != n) {
    PyErr_Format(PyExc_ValueError, "%zu local offsets for %zu runs", local.size(), n);
    return nullptr;
  }
  for (size_t i = 0; i < n; ++i) {
    if (outside(runs[2 * i], runs[2 * i + 1], remote_size)) {
      return raise_outside("remote", i, runs[2 * i], runs[2 * i + 1], remote_size);
    }
  }
  std::vector<uint64_t> rows;
  rows.reserve(3 * n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = runs[2 * i], len = runs[2 * i + 1], l = local[i];
    const size_t k = rows.size();
    if (k > 0 && rows[k - 3] + rows[k - 1] == r && rows[k - 2] + rows[k - 1] == l) {
      rows[k - 1] += len;  // continues the previous row on both sides
    } else {
      rows.insert(rows.end(), {r, l, len});
    }
    total += len;
  }
  for (size_t k = 0; k < rows.size() / 3; ++k) {
    if (outside(rows[3 * k + 1], rows[3 * k + 2], local_size)) {
      return raise_outside("local", k, rows[3 * k + 1], rows[3 * k + 2], local_size);
    }
  }
  PyObject* out = PyByteArray_FromStringAndSize(reinterpret_cast<const char*>(rows.data()),
                                                static_cast<Py_ssize_t>(rows.size() * 8));
  if (out == nullptr) return nullptr;
  return Py_BuildValue("(NK)", out, static_cast<unsigned long long>(total));
}

PyObject* set_bounds_error(PyObject*, PyObject* cls) {
  Py_XINCREF(cls);
  Py_XSETREF(bounds_error, cls);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"board_find", kvrelay_slot_board::board_find, METH_VARARGS,
     "board_find(table, gens, keys, num_slots, buckets, digests, out) -> bool: each digest's "
     "readable slot and generation off a mapped slot board"},
    {"fence", kvrelay_slot_board::fence, METH_NOARGS, "fence(): a sequentially consistent memory barrier"},
    {"plan_runs", plan_runs, METH_VARARGS,
     "plan_runs(remote_runs, local_offsets, remote_size, local_size) -> (rows, nbytes): "
     "bounds-checked, coalesced uint64 (remote, local, length) rows as a bytearray"},
    {"set_bounds_error", set_bounds_error, METH_O,
     "set_bounds_error(cls): the exception plan_runs raises for a run outside its region"},
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dst_base, src_base, triples, threads, stream_min_bytes[, prefetch]): copy "
     "uint64 (dst offset, src offset, length) rows; bounds are the caller's job"},
    {"readv_runs", readv_runs, METH_VARARGS,
     "readv_runs(pid, local_base, remote_base, triples, threads, write): the kernel copies "
     "uint64 (local offset, remote offset, length) rows out of (write: into) process pid"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_runcopy", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__runcopy() { return PyModule_Create(&module); }
