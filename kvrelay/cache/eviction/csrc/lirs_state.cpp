// The compiled prefix-LIRS policy's operations (see lirs_state.h); each is
// the reference's method of the same name in kvrelay/cache/eviction/lirs.py.
#include "lirs_state.h"

#include <algorithm>

namespace kvrelay::eviction {

LirsState::LirsState(const LirsParams& params)
    : map_(PyDict_New()),
      params_(params),
      hir_now_(params.hir_share),
      lir_share_(1 - params.hir_share) {}

LirsState::~LirsState() {
  for (Node& node : nodes_) Py_XDECREF(node.key);
  for (PyObject* obj : ints_) Py_XDECREF(obj);
  Py_XDECREF(map_);
}

// -- nodes --------------------------------------------------------------------------

int32_t LirsState::find(PyObject* key) {
  PyObject* found = PyDict_GetItemWithError(map_, key);  // borrowed
  if (found == nullptr) return PyErr_Occurred() ? -2 : NIL;
  return static_cast<int32_t>(PyLong_AsLong(found));
}

int32_t LirsState::create(PyObject* key) {
  int32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = static_cast<int32_t>(nodes_.size());
    PyObject* number = PyLong_FromLong(i);
    if (number == nullptr) return -2;
    nodes_.emplace_back();
    ints_.push_back(number);
  }
  if (PyDict_SetItem(map_, key, ints_[i]) < 0) {
    free_.push_back(i);
    return -2;
  }
  nodes_[i] = Node{};
  Py_INCREF(key);
  nodes_[i].key = key;
  return i;
}

// A node nothing refers to any more (not resident, not in S, no children
// counted under its key) gives its key back. Frees only; never called where
// a caller still compares node indices across an allocation.
void LirsState::maybe_free(int32_t i) {
  Node& node = nodes_[i];
  if (node.resident || node.s != S_OUT || node.children != 0) return;
  PyObject* key = node.key;
  node.key = nullptr;
  if (PyDict_DelItem(map_, key) < 0) PyErr_Clear();  // bytes keys cannot fail
  Py_DECREF(key);
  free_.push_back(i);
}

void LirsState::place(int32_t i) { q_push(i, nodes_[i].children ? Q_PARKED : Q_QUEUE); }

// -- the interface -----------------------------------------------------------------

bool LirsState::admit(PyObject* key, PyObject* parent, bool evictable) {
  int32_t i = find(key);
  if (i == -2) return false;
  if (i != NIL && nodes_[i].resident) return evictable ? make_evictable(key) : true;
  int32_t p = NIL;
  if (parent != Py_None) {
    p = find(parent);
    if (p == -2) return false;
    if (p != NIL && nodes_[p].resident) {
      ++nodes_[p].children;
      if (nodes_[p].q == Q_QUEUE || nodes_[p].q == Q_FRONT) {
        q_remove(p);
        q_push(p, Q_PARKED);
      }
    } else {
      p = NIL;
    }
  }
  if (i == NIL && (i = create(key)) == -2) return false;
  stamp(i);
  Node& node = nodes_[i];
  node.resident = true;
  node.parent = p;
  push_back(order_, i);
  ++n_resident_;
  if (node.s == S_OUT) {
    s_push(i, S_TOP, HIR);
    if (ghosts_ > params_.ghost_factor * n_resident_) drop_ghosts();
    if (!evictable) nodes_[i].held = true;
    else place(i);
    expire();
    return true;
  }
  // A ghost still in S: a short reuse.
  s_remove(i);
  if (!evictable) nodes_[i].held = true;
  --ghosts_;
  s_push(i, S_TOP, LIR);
  ++lirs_;
  if (over_lir_share()) demote_oldest();
  expire();
  return true;
}

bool LirsState::make_evictable(PyObject* key) {
  int32_t i = find(key);
  if (i == -2) return false;
  if (i == NIL || !nodes_[i].held) return true;
  nodes_[i].held = false;
  if (!(nodes_[i].s == S_TOP && nodes_[i].code == LIR)) place(i);
  return true;
}

bool LirsState::hold(PyObject* key) {
  int32_t i = find(key);
  if (i == -2) return false;
  if (i == NIL || nodes_[i].held || !nodes_[i].resident) return true;
  nodes_[i].held = true;
  q_remove(i);
  return true;
}

bool LirsState::touch_many(PyObject* const* keys, Py_ssize_t n) {
  // Each key's node once: no node is allocated until this returns, so the
  // indices stay valid (a node freed meanwhile reads as not resident).
  // One pass finds each key, counts the reads at the split's two boundaries
  // and stamps the resident pages (the reference's `_balance`, then its stamps).
  ++now_;  // a lookup: one tick of the clock, with hits or none
  if (n == 0) {
    expire();
    return true;
  }
  batch_.resize(static_cast<size_t>(n));
  int32_t marked[2 * 64];
  int n_marked = mark_bands(marked);
  Py_ssize_t band_reads[3] = {0, 0, 0};
  bool ok = true;
  for (Py_ssize_t j = 0; j < n; ++j) {
    int32_t i = find(keys[j]);
    if (i == -2) {
      ok = false;
      break;
    }
    batch_[j] = i;
    if (i == NIL) continue;
    ++band_reads[nodes_[i].band];
    if (nodes_[i].resident) stamp(i);
  }
  for (int k = 0; k < n_marked; ++k) nodes_[marked[k]].band = BAND_NONE;
  if (!ok) return false;  // (a key that cannot be hashed: nothing moved but times)
  if (band_reads[BAND_LIR]) move_split(-band_reads[BAND_LIR]);
  if (band_reads[BAND_Q]) move_split(band_reads[BAND_Q]);
  read(batch_.data(), n);
  expire();
  return true;
}

// LIRS's bookkeeping of a lookup's hits (the reference's `_read`).
void LirsState::read(const int32_t* nodes, Py_ssize_t n) {
  int32_t oldest = top_.head;
  if (lirs_ && nodes_[oldest].code != LIR) {
    split();
    oldest = top_.head;
  }
  auto top_code = [this](int32_t i) -> uint8_t {
    return i >= 0 && nodes_[i].s == S_TOP ? nodes_[i].code : NONE;
  };
  Py_ssize_t start = 0;
  if (n < top_.size) {
    // LIR pages first: one lookup and one move each.
    for (; start < n; ++start) {
      int32_t i = nodes[start];
      if (top_code(i) != LIR) break;
      unlink(top_, i);
      push_back(top_, i);
    }
    if (start == n) {
      if (top_.head != oldest) prune();
      return;
    }
  }
  bool shorten = start > 0 && top_.head != oldest;
  for (Py_ssize_t j = start; j < n; ++j) {
    int32_t i = nodes[j];
    uint8_t code = top_code(i);
    if (code == LIR) {
      unlink(top_, i);
      push_back(top_, i);
      if (i == oldest) shorten = true;
    } else {
      read_hir(i, code);
    }
  }
  if (shorten) prune();
}

bool LirsState::forget(PyObject* key) {
  int32_t i = find(key);
  if (i == -2) return false;
  if (i == NIL || !nodes_[i].resident) return true;
  Node& node = nodes_[i];
  node.held = false;
  q_remove(i);
  if (node.s != S_OUT) {
    if (node.s == S_TOP && node.code == LIR) --lirs_;
    s_remove(i);
  }
  leave(i);
  maybe_free(i);
  return true;
}

PyObject* LirsState::victim() {
  int32_t i;
  // The page at the front goes first unless the queue's head was read
  // before it (as the reference: the older of the two goes).
  if (front_.size && !(queue_.size && nodes_[queue_.head].last < nodes_[front_.tail].last)) {
    i = pop_back(front_);
  } else if (queue_.size) {
    i = pop_front(queue_);
  } else {
    while (!queue_.size && lirs_) demote_oldest();  // places pages at Q's tail
    if (queue_.size) i = pop_front(queue_);
    else if (parked_.size) i = pop_front(parked_);  // nothing else can go
    else Py_RETURN_NONE;
  }
  Node& node = nodes_[i];
  node.q = Q_OUT;
  if (node.s != S_OUT) {
    node.code = GHOST;  // keeps its place in S
    ++ghosts_;
  }
  leave(i);
  PyObject* key = nodes_[i].key;
  Py_INCREF(key);
  maybe_free(i);
  return key;
}

PyObject* LirsState::evictable() const {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (int32_t i = order_.head; i != NIL; i = nodes_[i].r_link.next) {
    if (!nodes_[i].held && PyList_Append(out, nodes_[i].key) < 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

int LirsState::contains(PyObject* key) {
  int32_t i = find(key);
  if (i == -2) return -1;
  return i != NIL && nodes_[i].resident;
}

// -- internals -----------------------------------------------------------------------

// The page is no longer resident: out of the resident order, and no longer
// counted as its parent's child.
void LirsState::leave(int32_t i) {
  nodes_[i].resident = false;
  unlink(order_, i);
  --n_resident_;
  int32_t p = nodes_[i].parent;
  nodes_[i].parent = NIL;
  if (p != NIL) orphan(p);
}

// A child of `parent` is gone: if it was the last resident one, the parent
// leaves the parked pages for the front of Q.
void LirsState::orphan(int32_t parent) {
  if (--nodes_[parent].children) return;
  if (nodes_[parent].q == Q_PARKED) {
    q_remove(parent);
    q_push(parent, Q_FRONT);
  }
  maybe_free(parent);
}

void LirsState::read_hir(int32_t i, uint8_t code) {
  if (i == NIL || !nodes_[i].resident) return;
  if (code == NONE && nodes_[i].s == S_TAIL) {
    code = nodes_[i].code;
    s_remove(i);
  }
  if (code == NONE) {
    s_push(i, S_TOP, HIR);
    if (nodes_[i].q == Q_QUEUE) {
      unlink(queue_, i);
      push_back(queue_, i);
    } else if (nodes_[i].q == Q_FRONT) {  // from Q's front to its tail
      q_remove(i);
      q_push(i, Q_QUEUE);
    }
    return;
  }
  if (nodes_[i].s == S_TOP) s_remove(i);
  s_push(i, S_TOP, LIR);
  q_remove(i);
  ++lirs_;
  if (over_lir_share()) demote_oldest();
}

void LirsState::split() {
  while (nodes_[top_.head].code != LIR) {
    int32_t i = pop_front(top_);
    nodes_[i].s = S_TAIL;
    push_back(tail_, i);
  }
}

void LirsState::demote_oldest() {
  int32_t i = pop_front(top_);
  while (nodes_[i].code != LIR) {  // entries below it go to the tail, in order
    nodes_[i].s = S_TAIL;
    push_back(tail_, i);
    i = pop_front(top_);
  }
  nodes_[i].s = S_OUT;
  --lirs_;
  if (!nodes_[i].held) place(i);
  prune();
}

void LirsState::prune() {
  if (!lirs_) return;
  Py_ssize_t extra = top_.size + tail_.size - n_resident_;
  Py_ssize_t ghosts = 0;
  while (extra > 0 && tail_.size) {  // the tail is the oldest part
    int32_t i = pop_front(tail_);
    nodes_[i].s = S_OUT;
    ghosts += nodes_[i].code == GHOST;
    --extra;
    maybe_free(i);
  }
  // `top_`'s entries below its oldest LIR page: the first `extra` leave S,
  // the rest go to the tail.
  while (nodes_[top_.head].code != LIR) {
    int32_t i = pop_front(top_);
    if (extra > 0) {
      nodes_[i].s = S_OUT;
      ghosts += nodes_[i].code == GHOST;
      --extra;
      maybe_free(i);
    } else {
      nodes_[i].s = S_TAIL;
      push_back(tail_, i);
    }
  }
  ghosts_ -= ghosts;
}

void LirsState::drop_ghosts() {
  Py_ssize_t keep = params_.ghost_factor * n_resident_ / 2;
  std::vector<int32_t> old;
  for (const List* part : {&tail_, &top_}) {
    for (int32_t i = part->head; i != NIL; i = nodes_[i].s_link.next) {
      if (nodes_[i].code == GHOST) old.push_back(i);
    }
  }
  Py_ssize_t count = static_cast<Py_ssize_t>(old.size());
  for (Py_ssize_t k = 0; k < std::max<Py_ssize_t>(0, count - keep); ++k) {
    s_remove(old[k]);
    maybe_free(old[k]);
  }
  ghosts_ = std::min(count, keep);
}

}  // namespace kvrelay::eviction
