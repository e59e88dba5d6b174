// The slot board's operations of kvrelay.transfer._runcopy
// (slot_board_ops.cpp); run_copy.cpp puts them in the module's table.
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace kvrelay_slot_board {

PyObject* fence(PyObject*, PyObject*);
PyObject* board_find(PyObject*, PyObject* args);

}  // namespace kvrelay_slot_board
