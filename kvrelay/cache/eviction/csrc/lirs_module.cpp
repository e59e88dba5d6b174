// kvrelay.cache.eviction._lirs: the compiled prefix-LIRS policy as a Python
// type. Plain CPython (no pybind11): a call costs what a builtin's does,
// which is the point of compiling it. kvrelay.cache.eviction.compiled wraps
// it as an EvictionPolicy; the reference is kvrelay.cache.eviction.lirs.
#include <Python.h>

#include <new>

#include "lirs_state.h"

namespace {

using kvrelay::eviction::LirsParams;
using kvrelay::eviction::LirsState;

struct PolicyObject {
  PyObject_HEAD
  LirsState* state;
};

LirsState* state_of(PyObject* self) {
  LirsState* state = reinterpret_cast<PolicyObject*>(self)->state;
  if (state == nullptr) PyErr_SetString(PyExc_RuntimeError, "PrefixLIRS.__init__ was not called");
  return state;
}

PyObject* done(bool ok) {
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

int policy_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"hir_share",  "ghost_factor", "share_low", "share_high",
                                "share_band", "stale_factor", nullptr};
  LirsParams p;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|dlddld", const_cast<char**>(names),
                                   &p.hir_share, &p.ghost_factor, &p.share_low, &p.share_high,
                                   &p.share_band, &p.stale_factor))
    return -1;
  if (!(0 < p.share_low && p.share_low <= p.hir_share && p.hir_share <= p.share_high &&
        p.share_high < 1) ||
      p.ghost_factor < 1 || p.share_band < 1 || p.share_band > 64 || !(p.stale_factor > 0)) {
    PyErr_SetString(PyExc_ValueError,
                    "need 0 < share_low <= hir_share <= share_high < 1, ghost_factor >= 1, "
                    "1 <= share_band <= 64 and stale_factor > 0");
    return -1;
  }
  auto* object = reinterpret_cast<PolicyObject*>(self);
  delete object->state;
  object->state = new (std::nothrow) LirsState(p);
  if (object->state == nullptr) {
    PyErr_NoMemory();
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
  LirsState* state = state_of(self);
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
  if (evictable < 0) return nullptr;
  return done(state->admit(given[0], given[1], evictable));
}

#define KVRELAY_ONE_KEY(NAME)                              \
  PyObject* policy_##NAME(PyObject* self, PyObject* key) { \
    LirsState* state = state_of(self);                     \
    return state ? done(state->NAME(key)) : nullptr;       \
  }
KVRELAY_ONE_KEY(make_evictable)
KVRELAY_ONE_KEY(hold)
KVRELAY_ONE_KEY(forget)
#undef KVRELAY_ONE_KEY

PyObject* policy_touch(PyObject* self, PyObject* key) {
  LirsState* state = state_of(self);
  return state ? done(state->touch_many(&key, 1)) : nullptr;
}

PyObject* policy_touch_many(PyObject* self, PyObject* keys) {
  LirsState* state = state_of(self);
  if (state == nullptr) return nullptr;
  PyObject* seq = PySequence_Fast(keys, "touch_many() takes a sequence of keys");
  if (seq == nullptr) return nullptr;
  bool ok = state->touch_many(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
  Py_DECREF(seq);
  return done(ok);
}

PyObject* policy_victim(PyObject* self, PyObject*) {
  LirsState* state = state_of(self);
  return state ? state->victim() : nullptr;
}

PyObject* policy_evictable(PyObject* self, PyObject*) {
  LirsState* state = state_of(self);
  if (state == nullptr) return nullptr;
  PyObject* keys = state->evictable();
  if (keys == nullptr) return nullptr;
  PyObject* it = PyObject_GetIter(keys);
  Py_DECREF(keys);
  return it;
}

PyObject* policy_debug_state(PyObject* self, PyObject*) {
  LirsState* state = state_of(self);
  return state ? state->debug_state() : nullptr;
}

Py_ssize_t policy_len(PyObject* self) {
  LirsState* state = state_of(self);
  return state ? state->resident() : -1;
}

int policy_contains(PyObject* self, PyObject* key) {
  LirsState* state = state_of(self);
  return state ? state->contains(key) : -1;
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
    {"evictable", policy_evictable, METH_NOARGS, "evictable() -> iterator of keys"},
    {"debug_state", policy_debug_state, METH_NOARGS,
     "debug_state() -> the state in the reference's terms (compiled.reference_state), for tests"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods sequence_methods = {
    policy_len, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, policy_contains,
};

PyTypeObject policy_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lirs", "The compiled prefix-LIRS policy.", -1,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__lirs() {
  policy_type.tp_name = "kvrelay.cache.eviction._lirs.PrefixLIRS";
  policy_type.tp_basicsize = sizeof(PolicyObject);
  policy_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  policy_type.tp_doc =
      "PrefixLIRS(hir_share=0.3, ghost_factor=8, share_low=0.05, share_high=0.7, share_band=4, "
      "stale_factor=1.5): prefix-LIRS, compiled";
  policy_type.tp_new = PyType_GenericNew;
  policy_type.tp_init = policy_init;
  policy_type.tp_dealloc = policy_dealloc;
  policy_type.tp_methods = methods;
  policy_type.tp_as_sequence = &sequence_methods;
  if (PyType_Ready(&policy_type) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&policy_type);
  if (PyModule_AddObject(m, "PrefixLIRS", reinterpret_cast<PyObject*>(&policy_type)) < 0) {
    Py_DECREF(&policy_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
