// The slot board's operations in kvrelay.transfer._runcopy (the module's
// method table is run_copy.cpp's): a cache server's shared-memory map of
// which slot holds which sealed page (kvrelay.cache.slot_board), read by
// same-host clients as a seqlock.
#include "slot_board_ops.h"

#include <atomic>
#include <cstdint>
#include <cstring>

namespace kvrelay_slot_board {

// A full memory barrier: shared-memory readers and writers of the cache
// server's slot board order their loads and stores with it (a no-op on x86's
// total store order for loads, a real dmb on arm64).
PyObject* fence(PyObject*, PyObject*) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  Py_RETURN_NONE;
}

// board_find(table, gens, keys, num_slots, buckets, digests, out) -> bool
//   A cache server's slot board (kvrelay.cache.slot_board) mapped here:
//   `table` (buckets x 8 int64, slot + 1 or 0), `gens` (uint64 per slot) and
//   `keys` (32 bytes per slot) are the addresses of its arrays. For each
//   32-byte digest, the first way of its bucket (the low bits of its first
//   little-endian word) naming an in-range slot whose generation is even and
//   whose key is the digest: (slot, generation) into `out` (2 uint64 per
//   digest). True when every digest was found. Each generation is loaded
//   with acquire order before that slot's key (reference:
//   kvrelay.cache.slot_board.find_reference).
PyObject* board_find(PyObject*, PyObject* args) {
  unsigned long long table_addr, gens_addr, keys_addr, num_slots, buckets;
  Py_buffer digests, out;
  if (!PyArg_ParseTuple(args, "KKKKKy*w*", &table_addr, &gens_addr, &keys_addr, &num_slots,
                        &buckets, &digests, &out)) {
    return nullptr;
  }
  const size_t n = static_cast<size_t>(digests.len) / 32;
  bool ok = digests.len % 32 == 0 && static_cast<size_t>(out.len) >= 16 * n && num_slots > 0 &&
            buckets > 0 && (buckets & (buckets - 1)) == 0;
  auto* table = reinterpret_cast<int64_t*>(table_addr);
  auto* gens = reinterpret_cast<uint64_t*>(gens_addr);
  auto* keys = reinterpret_cast<uint64_t*>(keys_addr);
  auto* found = static_cast<uint64_t*>(out.buf);
  for (size_t i = 0; ok && i < n; ++i) {
    uint64_t digest[4];
    std::memcpy(digest, static_cast<const char*>(digests.buf) + 32 * i, 32);
    int64_t* row = table + (digest[0] & (buckets - 1)) * 8;
    bool hit = false;
    for (int way = 0; way < 8 && !hit; ++way) {
      const int64_t entry = __atomic_load_n(row + way, __ATOMIC_RELAXED);
      if (entry <= 0 || static_cast<uint64_t>(entry) > num_slots) continue;
      const uint64_t slot = static_cast<uint64_t>(entry) - 1;
      const uint64_t gen = __atomic_load_n(gens + slot, __ATOMIC_ACQUIRE);
      if (gen & 1) continue;
      hit = true;
      for (int w = 0; w < 4; ++w) hit &= __atomic_load_n(keys + 4 * slot + w, __ATOMIC_RELAXED) == digest[w];
      if (hit) {
        found[2 * i] = slot;
        found[2 * i + 1] = gen;
      }
    }
    ok = hit;
  }
  PyBuffer_Release(&digests);
  PyBuffer_Release(&out);
  return PyBool_FromLong(ok);
}

}  // namespace kvrelay_slot_board
