// kvrelay.cache.eviction._prefix_lru: the compiled prefix-LRU policy, the
// index's default. Plain CPython (no pybind11): a call costs what a builtin's
// does. Every operation mirrors the method of the same name of the reference,
// PrefixLRUReference in kvrelay/cache/eviction/prefix.py, step for step;
// tests/cache/test_prefix_lru.py compares both states after every call.
//
// Why compiled: in Python each page admitted is an object and two or three
// calls, which made the index's insert 1.6x as slow as under LRU; here a page
// is a node in one vector, found through one dict from key to node index.
#include <Python.h>

#include <new>

#include "prefix_lru_state.h"

namespace {

using kvrelay::eviction::prefix_lru::NIL;
using kvrelay::eviction::prefix_lru::State;

struct PolicyObject {
  PyObject_HEAD
  State* state;
};

State* state_of(PyObject* self) {
  State* state = reinterpret_cast<PolicyObject*>(self)->state;
  if (state == nullptr) PyErr_SetString(PyExc_RuntimeError, "PrefixLRU.__init__ was not called");
  return state;
}

int policy_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"guess_weight", nullptr};
  long weight = 16;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|l:PrefixLRU", const_cast<char**>(names),
                                   &weight))
    return -1;
  if (weight < 1) {
    PyErr_SetString(PyExc_ValueError, "guess_weight must be >= 1");
    return -1;
  }
  auto* object = reinterpret_cast<PolicyObject*>(self);
  delete object->state;
  object->state = new (std::nothrow) State(weight);
  if (object->state == nullptr || !object->state->ok()) {
    delete object->state;
    object->state = nullptr;
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return -1;
  }
  return 0;
}

void policy_dealloc(PyObject* self) {
  delete reinterpret_cast<PolicyObject*>(self)->state;
  Py_TYPE(self)->tp_free(self);
}

// admit(key, parent=None, evictable=False), parsed by hand: the index calls
// it once per page.
PyObject* policy_admit(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  State* state = state_of(self);
  if (state == nullptr) return nullptr;
  PyObject* given[3] = {nullptr, Py_None, Py_False};
  static const char* names[] = {"key", "parent", "evictable"};
  if (nargs > 3) {
    PyErr_SetString(PyExc_TypeError, "admit() takes at most 3 arguments");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) given[i] = args[i];
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    int slot = -1;
    for (int j = 0; j < 3; ++j) {
      if (PyUnicode_CompareWithASCIIString(name, names[j]) == 0) slot = j;
    }
    if (slot < nargs) {
      PyErr_Format(PyExc_TypeError, "admit() got an unexpected or repeated argument %R", name);
      return nullptr;
    }
    given[slot] = args[nargs + k];
  }
  if (given[0] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "admit() missing its key");
    return nullptr;
  }
  int evictable = PyObject_IsTrue(given[2]);
  if (evictable < 0 || !state->admit(given[0], given[1], evictable)) return nullptr;
  Py_RETURN_NONE;
}

// The one-key calls: a no-op for a key not resident, as in the reference.
#define KVRELAY_ONE_KEY(NAME)                              \
  PyObject* policy_##NAME(PyObject* self, PyObject* key) { \
    State* state = state_of(self);                         \
    if (state == nullptr) return nullptr;                  \
    int32_t i = state->find(key);                          \
    if (i == -2) return nullptr;                           \
    if (i != NIL) state->NAME(i);                          \
    Py_RETURN_NONE;                                        \
  }
KVRELAY_ONE_KEY(make_evictable)
KVRELAY_ONE_KEY(hold)
KVRELAY_ONE_KEY(forget)
#undef KVRELAY_ONE_KEY

PyObject* policy_touch(PyObject* self, PyObject* key) {  // a lookup with one hit
  State* state = state_of(self);
  if (state == nullptr) return nullptr;
  int32_t i = state->find(key);
  if (i == -2) return nullptr;
  state->lookup_done(1);
  if (i != NIL) state->touch(i);
  Py_RETURN_NONE;
}

PyObject* policy_touch_many(PyObject* self, PyObject* keys) {
  State* state = state_of(self);
  if (state == nullptr) return nullptr;
  PyObject* seq = PySequence_Fast(keys, "touch_many() takes a sequence of keys");
  if (seq == nullptr) return nullptr;
  PyObject** items = PySequence_Fast_ITEMS(seq);
  state->lookup_done(PySequence_Fast_GET_SIZE(seq));
  for (Py_ssize_t k = 0, n = PySequence_Fast_GET_SIZE(seq); k < n; ++k) {
    int32_t i = state->find(items[k]);
    if (i == -2) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (i != NIL) state->touch(i);
  }
  Py_DECREF(seq);
  Py_RETURN_NONE;
}

PyObject* policy_victim(PyObject* self, PyObject*) {
  State* state = state_of(self);
  return state ? state->victim() : nullptr;
}

PyObject* policy_victim_inner(PyObject* self, PyObject*) {
  State* state = state_of(self);
  return state ? state->victim_inner() : nullptr;
}

PyObject* policy_evictable(PyObject* self, PyObject*) {
  State* state = state_of(self);
  if (state == nullptr) return nullptr;
  PyObject* keys = state->evictable();
  if (keys == nullptr) return nullptr;
  PyObject* it = PyObject_GetIter(keys);
  Py_DECREF(keys);
  return it;
}

PyObject* policy_debug_state(PyObject* self, PyObject*) {
  State* state = state_of(self);
  return state ? state->debug_state() : nullptr;
}

Py_ssize_t policy_len(PyObject* self) {
  State* state = state_of(self);
  return state ? state->size() : -1;
}

int policy_contains(PyObject* self, PyObject* key) {
  State* state = state_of(self);
  if (state == nullptr) return -1;
  int32_t i = state->find(key);
  return i == -2 ? -1 : i != NIL;
}

PyMethodDef methods[] = {
    {"admit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(policy_admit)),
     METH_FASTCALL | METH_KEYWORDS, "admit(key, parent=None, evictable=False)"},
    {"make_evictable", policy_make_evictable, METH_O, "make_evictable(key)"},
    {"hold", policy_hold, METH_O, "hold(key)"},
    {"touch", policy_touch, METH_O, "touch(key)"},
    {"touch_many", policy_touch_many, METH_O, "touch_many(keys)"},
    {"forget", policy_forget, METH_O, "forget(key)"},
    {"victim", policy_victim, METH_NOARGS, "victim() -> key or None"},
    {"victim_inner", policy_victim_inner, METH_NOARGS, "victim_inner() -> key or None"},
    {"evictable", policy_evictable, METH_NOARGS, "evictable() -> iterator of keys"},
    {"debug_state", policy_debug_state, METH_NOARGS,
     "debug_state() -> the state as prefix.reference_state gives it, for tests"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods sequence_methods = {
    policy_len, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, policy_contains,
};

PyTypeObject policy_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_lru", "The compiled prefix-LRU policy.",
                      -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__prefix_lru() {
  policy_type.tp_name = "kvrelay.cache.eviction._prefix_lru.PrefixLRU";
  policy_type.tp_basicsize = sizeof(PolicyObject);
  policy_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  policy_type.tp_doc = "PrefixLRU(guess_weight=16): prefix-LRU, compiled";
  policy_type.tp_new = PyType_GenericNew;
  policy_type.tp_init = policy_init;
  policy_type.tp_dealloc = policy_dealloc;
  policy_type.tp_methods = methods;
  policy_type.tp_as_sequence = &sequence_methods;
  if (PyType_Ready(&policy_type) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&policy_type);
  if (PyModule_AddObject(m, "PrefixLRU", reinterpret_cast<PyObject*>(&policy_type)) < 0) {
    Py_DECREF(&policy_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
