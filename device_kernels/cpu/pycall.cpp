// commref_pycall — a CPython extension that calls one C entry of the CPU library with
// its arguments bound once, so that a repeated launch costs a method call instead of a
// ctypes conversion (cpu_loader.BoundCall).
//
//   Bound(entry, arg)        calling it runs  int entry(const void* arg)
//   Bound(entry, arg, n)     calling it runs  int entry(const void* arg, unsigned n)
//
// `entry` and `arg` are addresses (ints); the caller keeps what they point to alive for
// as long as the Bound object lives. A call takes no arguments, releases the GIL while
// the entry runs (ranks that are threads of one process wait for each other inside it)
// and returns the entry's int.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>

namespace {

using Entry1 = int (*)(const void*);
using Entry2 = int (*)(const void*, unsigned);

struct Bound {
  PyObject_HEAD void* entry;
  const void* arg;
  long long n;  // < 0: the one-argument form
  vectorcallfunc vectorcall;
};

PyObject* boundCall(PyObject* self, PyObject* const*, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a bound CPU launch takes no arguments");
    return nullptr;
  }
  const Bound* b = reinterpret_cast<const Bound*>(self);
  int status;
  Py_BEGIN_ALLOW_THREADS;
  if (b->n < 0)
    status = reinterpret_cast<Entry1>(b->entry)(b->arg);
  else
    status = reinterpret_cast<Entry2>(b->entry)(b->arg, static_cast<unsigned>(b->n));
  Py_END_ALLOW_THREADS;
  return PyLong_FromLong(status);
}

int boundInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  unsigned long long entry = 0, arg = 0;
  long long n = -1;
  static const char* names[] = {"entry", "arg", "n", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KK|L", const_cast<char**>(names), &entry, &arg, &n)) return -1;
  if (entry == 0) {
    PyErr_SetString(PyExc_ValueError, "a bound CPU launch needs a nonzero entry address");
    return -1;
  }
  if (n > 0xffffffffLL) {
    PyErr_SetString(PyExc_ValueError, "a bound CPU launch's count must fit in 32 bits");
    return -1;
  }
  Bound* b = reinterpret_cast<Bound*>(self);
  b->entry = reinterpret_cast<void*>(static_cast<uintptr_t>(entry));
  b->arg = reinterpret_cast<const void*>(static_cast<uintptr_t>(arg));
  b->n = n;
  b->vectorcall = boundCall;
  return 0;
}

PyTypeObject BoundType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "commref_pycall", "Bound calls of the CPU library's entries.", -1};

}  // namespace

PyMODINIT_FUNC PyInit_commref_pycall() {
  BoundType.tp_name = "commref_pycall.Bound";
  BoundType.tp_basicsize = sizeof(Bound);
  BoundType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  BoundType.tp_new = PyType_GenericNew;
  BoundType.tp_init = boundInit;
  BoundType.tp_call = PyVectorcall_Call;
  BoundType.tp_vectorcall_offset = offsetof(Bound, vectorcall);
  BoundType.tp_doc = "Bound(entry, arg[, n]): calling it runs entry(arg) or entry(arg, n) without the GIL.";
  if (PyType_Ready(&BoundType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&BoundType);
  if (PyModule_AddObject(m, "Bound", reinterpret_cast<PyObject*>(&BoundType)) < 0) {
    Py_DECREF(&BoundType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
