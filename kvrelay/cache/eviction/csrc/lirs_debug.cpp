// LirsState::debug_state: the state in the reference's terms (its dicts, in
// their order), so tests compare the compiled policy with the reference
// after every call.
#include "lirs_state.h"

namespace kvrelay::eviction {

namespace {

// Adds `value` (a new reference, may be null) under `name`; false on error.
bool put(PyObject* out, const char* name, PyObject* value) {
  if (value == nullptr) return false;
  int rc = PyDict_SetItemString(out, name, value);
  Py_DECREF(value);
  return rc == 0;
}

}  // namespace

PyObject* LirsState::debug_state() const {
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  auto keys_of = [this](const List& list, bool with_code) -> PyObject* {
    PyObject* items = PyList_New(0);
    for (int32_t i = list.head; items != nullptr && i != NIL;) {
      const Node& node = nodes_[i];
      PyObject* item = with_code ? Py_BuildValue("(Oi)", node.key, int(node.code)) : node.key;
      if (!with_code) Py_INCREF(item);
      if (item == nullptr || PyList_Append(items, item) < 0) Py_CLEAR(items);
      Py_XDECREF(item);
      i = link(i, list.via).next;
    }
    return items;
  };
  PyObject* resident = PyDict_New();
  PyObject* children = PyDict_New();
  PyObject* held = PySet_New(nullptr);
  PyObject* times = PyDict_New();
  bool ok = resident && children && held && times;
  for (int32_t i = order_.head; ok && i != NIL; i = nodes_[i].r_link.next) {
    const Node& node = nodes_[i];
    PyObject* parent = node.parent == NIL ? Py_None : nodes_[node.parent].key;
    ok = PyDict_SetItem(resident, node.key, parent) == 0 &&
         (!node.held || PySet_Add(held, node.key) == 0);
  }
  auto or_none = [](int64_t gap) -> PyObject* {
    if (gap) return PyLong_FromLongLong(gap);
    Py_RETURN_NONE;
  };
  for (const Node& node : nodes_) {
    if (!ok) break;
    if (node.key == nullptr) continue;
    if (node.children) {
      PyObject* count = PyLong_FromLong(node.children);
      ok = count && PyDict_SetItem(children, node.key, count) == 0;
      Py_XDECREF(count);
    }
    // Every node in use was stamped when admitted.
    PyObject* when = Py_BuildValue("(LNN)", static_cast<long long>(node.last), or_none(node.gap),
                                   or_none(node.gap2));
    ok = ok && when && PyDict_SetItem(times, node.key, when) == 0;
    Py_XDECREF(when);
  }
  ok = ok && put(out, "resident", resident) && put(out, "children", children) &&
       put(out, "held", held) && put(out, "times", times);
  if (!ok) {
    Py_DECREF(out);
    return nullptr;
  }
  if (!put(out, "top", keys_of(top_, true)) || !put(out, "tail", keys_of(tail_, true)) ||
      !put(out, "front", keys_of(front_, false)) ||
      !put(out, "queue", keys_of(queue_, false)) ||
      !put(out, "parked", keys_of(parked_, false)) ||
      !put(out, "lirs", PyLong_FromSsize_t(lirs_)) ||
      !put(out, "ghosts", PyLong_FromSsize_t(ghosts_)) ||
      !put(out, "now", PyLong_FromLongLong(now_)) ||
      !put(out, "finished_read", PyLong_FromLongLong(finished_read_)) ||
      !put(out, "hir_share", PyFloat_FromDouble(hir_now_))) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

}  // namespace kvrelay::eviction
