// The state of the compiled prefix-LRU policy (kvrelay.cache.eviction._prefix_lru):
// pages as nodes in one vector, found through one dict from key to node index,
// linked into the recency order, the parked pages and the cold leaves. Every
// operation mirrors the method of the same name of the reference,
// PrefixLRUReference in kvrelay/cache/eviction/prefix.py, step for step;
// tests/cache/test_prefix_lru.py compares both states after every call.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace kvrelay::eviction::prefix_lru {


constexpr int32_t NIL = -1;
enum Where : uint8_t { HELD = 0, ORDER = 1, PARKED = 2 };

struct Node {
  PyObject* key = nullptr;  // a strong reference while the node is in use
  int32_t parent = NIL;     // the parent node it was admitted under ...
  uint32_t parent_gen = 0;  // ... while that node's generation is this one
  uint32_t gen = 0;         // bumped when the node leaves: children see their parent gone
  int32_t children = 0;
  uint8_t where = HELD;
  bool cold = false;  // guessed dead: admitted after a lookup with no hit, unread since
  bool in_cold = false;            // in the cold leaves
  int32_t prev = NIL, next = NIL;  // in the order or the parked pages
  int32_t cprev = NIL, cnext = NIL;  // in the cold leaves
};

struct List {
  int32_t head = NIL, tail = NIL;
};

class State {
 public:
  explicit State(long weight) : map_(PyDict_New()), early_(PyDict_New()), weight_(weight) {}
  ~State() {
    for (Node& node : nodes_) Py_XDECREF(node.key);
    for (PyObject* number : ints_) Py_DECREF(number);
    for (auto& entry : early_q_) Py_DECREF(entry.first);
    Py_XDECREF(map_);
    Py_XDECREF(early_);
  }
  bool ok() const { return map_ != nullptr && early_ != nullptr; }

  // Node index of `key`, NIL if not resident; -2 on error (exception set).
  int32_t find(PyObject* key) {
    PyObject* found = PyDict_GetItemWithError(map_, key);  // borrowed
    if (found == nullptr) return PyErr_Occurred() ? -2 : NIL;
    return static_cast<int32_t>(PyLong_AsLong(found));
  }

  bool admit(PyObject* key, PyObject* parent, bool evictable) {
    int32_t i = find(key);
    if (i == -2) return false;
    if (i == NIL) {
      int wanted = early_pop(key);  // evicted by the guess, and wanted
      if (wanted < 0) return false;
      wrong_ += wanted;
      int32_t up = NIL;
      if (parent != Py_None && (up = find(parent)) == -2) return false;
      if ((i = create(key)) < 0) return false;
      nodes_[i].cold = cold_next_;
      if (up != NIL) {
        nodes_[i].parent = up;
        nodes_[i].parent_gen = nodes_[up].gen;
        ++nodes_[up].children;
        cold_remove(up);
      }
    }
    if (evictable) make_evictable(i);
    return true;
  }

  void make_evictable(int32_t i) {
    if (nodes_[i].where != HELD) return;
    nodes_[i].where = ORDER;
    push_back(order_, i);
    if (nodes_[i].cold && nodes_[i].children == 0) cold_push(i, false);
  }

  void hold(int32_t i) { dequeue(i); }

  // A lookup's hits; `lookup_done` once per lookup, with `hits` its count.
  void lookup_done(Py_ssize_t hits) { cold_next_ = hits == 0; }

  void touch(int32_t i) {
    Node& node = nodes_[i];
    if (node.cold) {  // the guess was wrong
      node.cold = false;
      ++wrong_;
      cold_remove(i);
    }
    if (node.where == ORDER) {
      if (order_.tail != i) {
        unlink(order_, i);
        push_back(order_, i);
      }
    } else if (node.where == PARKED) {  // read while parked: back in the order, at its tail
      unlink(parked_, i);
      node.where = ORDER;
      push_back(order_, i);
    }
  }

  void forget(int32_t i) {
    dequeue(i);
    release(i);
  }

  // A new reference to the victim's key, or to None when every leaf is held.
  PyObject* victim() {
    if (cold_.head != NIL && weight_ * wrong_ < right_) {
      int32_t i = cold_.head;
      cold_remove(i);
      unlink(order_, i);
      if (!early_add(nodes_[i].key)) return nullptr;
      return leave(i);
    }
    while (order_.head != NIL) {
      int32_t i = order_.head;
      unlink(order_, i);
      if (nodes_[i].children == 0) {
        if (nodes_[i].cold) {  // left unread: the guess would have been right
          ++right_;
          cold_remove(i);
        }
        return leave(i);
      }
      nodes_[i].where = PARKED;  // an inner page at the head waits for its children
      push_back(parked_, i);
    }
    Py_RETURN_NONE;
  }

  // The oldest parked page (an ancestor of held pages), for an owner that
  // can demote it; None if none is parked.
  PyObject* victim_inner() {
    int32_t i = parked_.head;
    if (i == NIL) Py_RETURN_NONE;
    unlink(parked_, i);
    right_ += nodes_[i].cold;
    return leave(i);
  }

  // The evictable keys, in the order their pages became resident (the
  // reference's dict order: map_ gets the same inserts and deletes).
  PyObject* evictable() const {
    PyObject* out = PyList_New(0);
    if (out == nullptr) return nullptr;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(map_, &pos, &key, &value)) {
      if (nodes_[PyLong_AsLong(value)].where != HELD && PyList_Append(out, key) < 0) {
        Py_DECREF(out);
        return nullptr;
      }
    }
    return out;
  }

  Py_ssize_t size() const { return PyDict_GET_SIZE(map_); }

  PyObject* debug_state() const;

 private:
  int32_t create(PyObject* key) {
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
    uint32_t gen = nodes_[i].gen;
    nodes_[i] = Node{};
    nodes_[i].gen = gen;
    Py_INCREF(key);
    nodes_[i].key = key;
    return i;
  }

  PyObject* leave(int32_t i) {
    nodes_[i].where = HELD;
    PyObject* key = nodes_[i].key;
    Py_INCREF(key);
    release(i);
    return key;
  }

  // The guess's record of the pages it evicted (keys, oldest first, at most
  // max(64, resident pages)): early_ maps a key to the number of its entry
  // in early_q_, so an entry whose key left and came back is stale.
  bool early_add(PyObject* key) {
    PyObject* number = PyLong_FromLongLong(++early_seq_);
    if (number == nullptr) return false;
    int failed = PyDict_SetItem(early_, key, number);
    Py_DECREF(number);
    if (failed) return false;
    Py_INCREF(key);
    early_q_.emplace_back(key, early_seq_);
    Py_ssize_t cap = std::max<Py_ssize_t>(64, size());
    while (PyDict_GET_SIZE(early_) > cap) {
      auto [old, seq] = early_q_.front();
      early_q_.pop_front();
      if (early_live(old, seq) && PyDict_DelItem(early_, old) < 0) PyErr_Clear();
      Py_DECREF(old);
    }
    return true;
  }

  bool early_live(PyObject* key, long long seq) const {
    PyObject* found = PyDict_GetItem(early_, key);  // borrowed; bytes keys cannot fail
    return found != nullptr && PyLong_AsLongLong(found) == seq;
  }

  // 1 if `key` was in the record (and is no more), 0 if not, -1 on error.
  int early_pop(PyObject* key) {
    if (PyDict_GET_SIZE(early_) == 0) return 0;
    PyObject* found = PyDict_GetItemWithError(early_, key);
    if (found == nullptr) return PyErr_Occurred() ? -1 : 0;
    return PyDict_DelItem(early_, key) < 0 ? -1 : 1;
  }

  void cold_push(int32_t i, bool front) {
    Node& node = nodes_[i];
    node.in_cold = true;
    if (front) {
      node.cprev = NIL;
      node.cnext = cold_.head;
      if (cold_.head != NIL) nodes_[cold_.head].cprev = i;
      else cold_.tail = i;
      cold_.head = i;
    } else {
      node.cnext = NIL;
      node.cprev = cold_.tail;
      if (cold_.tail != NIL) nodes_[cold_.tail].cnext = i;
      else cold_.head = i;
      cold_.tail = i;
    }
  }

  void cold_remove(int32_t i) {
    Node& node = nodes_[i];
    if (!node.in_cold) return;
    if (node.cprev != NIL) nodes_[node.cprev].cnext = node.cnext;
    else cold_.head = node.cnext;
    if (node.cnext != NIL) nodes_[node.cnext].cprev = node.cprev;
    else cold_.tail = node.cprev;
    node.cprev = node.cnext = NIL;
    node.in_cold = false;
  }

  bool parent_here(const Node& node) const {
    return node.parent != NIL && nodes_[node.parent].gen == node.parent_gen;
  }

  // The page left: its node is freed and its parent loses a child.
  void release(int32_t i) {
    Node& node = nodes_[i];
    int32_t up = parent_here(node) ? node.parent : NIL;
    PyObject* key = node.key;
    node.key = nullptr;
    ++node.gen;
    if (PyDict_DelItem(map_, key) < 0) PyErr_Clear();  // it is there: cannot fail
    Py_DECREF(key);
    free_.push_back(i);
    if (up == NIL) return;
    Node& parent = nodes_[up];
    if (--parent.children != 0) return;
    if (parent.where == PARKED) {
      // Parked at the head and unread since: the least recently used.
      unlink(parked_, up);
      parent.where = ORDER;
      push_front(order_, up);
    }
    if (parent.cold && parent.where == ORDER) cold_push(up, true);  // a cold chain goes from its end
  }

  void dequeue(int32_t i) {
    Node& node = nodes_[i];
    if (node.where == ORDER) {
      unlink(order_, i);
      cold_remove(i);
    } else if (node.where == PARKED) {
      unlink(parked_, i);
    }
    node.where = HELD;
  }

  void push_back(List& list, int32_t i) {
    nodes_[i].prev = list.tail;
    nodes_[i].next = NIL;
    if (list.tail != NIL) nodes_[list.tail].next = i;
    else list.head = i;
    list.tail = i;
  }

  void push_front(List& list, int32_t i) {
    nodes_[i].prev = NIL;
    nodes_[i].next = list.head;
    if (list.head != NIL) nodes_[list.head].prev = i;
    else list.tail = i;
    list.head = i;
  }

  void unlink(List& list, int32_t i) {
    Node& node = nodes_[i];
    if (node.prev != NIL) nodes_[node.prev].next = node.next;
    else list.head = node.next;
    if (node.next != NIL) nodes_[node.next].prev = node.prev;
    else list.tail = node.prev;
    node.prev = node.next = NIL;
  }

  PyObject* keys_of(const List& list) const {
    PyObject* out = PyList_New(0);
    for (int32_t i = list.head; out != nullptr && i != NIL; i = nodes_[i].next) {
      if (PyList_Append(out, nodes_[i].key) < 0) Py_CLEAR(out);
    }
    return out;
  }

  PyObject* map_;  // key -> int (node index) of every resident page
  std::vector<Node> nodes_;
  std::vector<PyObject*> ints_;  // the int object of each node index, made once
  std::vector<int32_t> free_;
  List order_, parked_, cold_;  // cold_: cold leaves in the order, a chain's end first
  PyObject* early_;  // key -> entry number in early_q_
  std::deque<std::pair<PyObject*, long long>> early_q_;
  long long early_seq_ = 0, right_ = 0, wrong_ = 0;
  long weight_;
  bool cold_next_ = false;  // the last lookup hit nothing here
};

// {"order", "parked", "held", "children", "parent"}, as reference_state gives it.
inline PyObject* State::debug_state() const {
  PyObject* held = PyList_New(0);
  PyObject* children = PyDict_New();
  PyObject* parents = PyDict_New();
  PyObject* order = keys_of(order_);
  PyObject* parked = keys_of(parked_);
  PyObject* cold = PyList_New(0);
  PyObject* cold_leaves = PyList_New(0);
  PyObject* early = PyList_New(0);
  PyObject* out = nullptr;
  bool ok = held && children && parents && order && parked && cold && cold_leaves && early;
  for (int32_t i = cold_.head; ok && i != NIL; i = nodes_[i].cnext) {
    ok = PyList_Append(cold_leaves, nodes_[i].key) == 0;
  }
  for (auto& [key, seq] : early_q_) {
    if (ok && early_live(key, seq)) ok = PyList_Append(early, key) == 0;
  }
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (ok && PyDict_Next(map_, &pos, &key, &value)) {
    const Node& node = nodes_[PyLong_AsLong(value)];
    PyObject* count = PyLong_FromLong(node.children);
    PyObject* up = parent_here(node) ? nodes_[node.parent].key : Py_None;
    ok = count != nullptr && PyDict_SetItem(children, key, count) == 0 &&
         PyDict_SetItem(parents, key, up) == 0 &&
         (node.where != HELD || PyList_Append(held, key) == 0) &&
         (!node.cold || PyList_Append(cold, key) == 0);
    Py_XDECREF(count);
  }
  if (ok) {
    out = Py_BuildValue("{sOsOsOsOsOsOsOsOs(LLO)}", "order", order, "parked", parked, "held",
                        held, "children", children, "parent", parents, "cold", cold,
                        "cold_leaves", cold_leaves, "early", early, "counts", right_, wrong_,
                        cold_next_ ? Py_True : Py_False);
  }
  Py_XDECREF(cold);
  Py_XDECREF(cold_leaves);
  Py_XDECREF(early);
  Py_XDECREF(held);
  Py_XDECREF(children);
  Py_XDECREF(parents);
  Py_XDECREF(order);
  Py_XDECREF(parked);
  return out;
}

}  // namespace kvrelay::eviction::prefix_lru
