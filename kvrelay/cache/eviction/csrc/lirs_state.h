// The state of the compiled prefix-LIRS policy: pages as nodes in one vector,
// linked into the lists the reference (kvrelay/cache/eviction/lirs.py) keeps
// as dicts. Every operation here mirrors the reference's method of the same
// name step for step, so that both make the same choices on the same calls
// (tests/cache/test_lirs_compiled.py checks their whole state after each).
//
// Why compiled: the reference pays a Python call and a dict operation or two
// for every step; a read of a page is one dict lookup here, the rest is
// pointer work, so the policy costs the index no more than LRU does.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

namespace kvrelay::eviction {

constexpr int32_t NIL = -1;
// What S holds for a key (as the reference's _GHOST, _HIR, _LIR).
enum Code : uint8_t { GHOST = 0, HIR = 1, LIR = 2, NONE = 3 };
// Which part of S a node is in.
enum SPart : uint8_t { S_OUT, S_TOP, S_TAIL };
// Which boundary of the LIR/HIR split a node is at, during touch_many.
enum Band : uint8_t { BAND_NONE = 0, BAND_LIR = 1, BAND_Q = 2 };
// Which of Q's parts (or the parked pages) a node is in.
enum QPart : uint8_t { Q_OUT, Q_FRONT, Q_QUEUE, Q_PARKED };

struct Link {
  int32_t prev = NIL, next = NIL;
};

struct Node {
  PyObject* key = nullptr;  // a strong reference while the node is in use
  int32_t parent = NIL;     // the resident parent it was admitted under
  int32_t children = 0;     // resident pages admitted under this key
  uint8_t code = GHOST;     // valid while s != S_OUT
  uint8_t s = S_OUT, q = Q_OUT;
  uint8_t band = 0;  // during touch_many: BAND_LIR or BAND_Q (lirs_adapt.cpp)
  bool resident = false, held = false;
  Link s_link, q_link, r_link;  // in S, in Q or parked, in resident order
  // In the policy's clock (lirs_adapt.cpp): the last read (-1: none yet) and
  // the last two reuse intervals (0: none; an interval is at least 1).
  int64_t last = -1, gap = 0, gap2 = 0;
};

// The reference's class attributes (kvrelay/cache/eviction/lirs_adapt.py).
struct LirsParams {
  double hir_share = 0.3;  // at the start
  long ghost_factor = 8;
  double share_low = 0.05, share_high = 0.7;
  long share_band = 4;
  double stale_factor = 1.5;
};

// Which of a node's links a list threads through.
enum Via : uint8_t { VIA_S, VIA_Q, VIA_ORDER };

// A doubly linked list of nodes through one of their links; head is the oldest.
struct List {
  explicit List(Via through) : via(through) {}
  const Via via;
  int32_t head = NIL, tail = NIL;
  Py_ssize_t size = 0;
};

class LirsState {
 public:
  explicit LirsState(const LirsParams& params);
  ~LirsState();

  // Each returns false with a Python exception set on failure.
  bool admit(PyObject* key, PyObject* parent, bool evictable);
  bool make_evictable(PyObject* key);
  bool hold(PyObject* key);
  bool touch_many(PyObject* const* keys, Py_ssize_t n);
  bool forget(PyObject* key);
  // A new reference to the victim's key, Py_None (new reference) if none.
  PyObject* victim();
  PyObject* evictable() const;  // list of keys, in the order they became resident
  int contains(PyObject* key);  // -1 on error
  Py_ssize_t resident() const { return n_resident_; }
  PyObject* debug_state() const;  // the lists and counters, for tests

 private:
  // Node index of `key`, NIL if unknown; -2 on error (exception set).
  int32_t find(PyObject* key);
  int32_t create(PyObject* key);
  void maybe_free(int32_t i);

  Link& link(int32_t i, Via via);
  const Link& link(int32_t i, Via via) const;
  void push_back(List& list, int32_t i);
  void unlink(List& list, int32_t i);
  int32_t pop_front(List& list);
  int32_t pop_back(List& list);

  List& s_list(uint8_t part) { return part == S_TOP ? top_ : tail_; }
  void s_push(int32_t i, SPart part, uint8_t code);
  void s_remove(int32_t i);
  List& q_list(uint8_t part);
  void q_push(int32_t i, QPart part);
  void q_remove(int32_t i);

  void place(int32_t i);  // an evictable HIR page: parked if inner, queued if a leaf
  void leave(int32_t i);
  void orphan(int32_t parent);
  void read_hir(int32_t i, uint8_t code);
  void split();
  void demote_oldest();
  void prune();
  void drop_ghosts();
  bool over_lir_share() const { return lirs_ > lir_share_ * static_cast<double>(n_resident_); }
  void read(const int32_t* nodes, Py_ssize_t n);

  // lirs_adapt.cpp: the clock, the finished-page test and the moving split.
  void stamp(int32_t i);  // read or admitted now
  int mark_bands(int32_t* marked);  // the nodes marked, in `marked` (at most 2 x 64)
  void move_split(Py_ssize_t pages);
  void expire();

  PyObject* map_;  // key -> int (node index)
  std::vector<Node> nodes_;
  std::vector<PyObject*> ints_;  // the int object of each node index, made once
  std::vector<int32_t> free_;
  List top_{VIA_S}, tail_{VIA_S};  // S: its newer part from the oldest LIR page, and older
  List front_{VIA_Q}, queue_{VIA_Q}, parked_{VIA_Q};
  List order_{VIA_ORDER};  // resident pages, in the order they became resident
  std::vector<int32_t> batch_;  // touch_many's node indices, reused
  Py_ssize_t n_resident_ = 0, lirs_ = 0, ghosts_ = 0;
  LirsParams params_;
  int64_t now_ = 0;
  int64_t finished_read_ = -1;  // when the last page found finished was read
  double hir_now_, lir_share_;
};

}  // namespace kvrelay::eviction
