// commref_pycall — a CPython extension for the CPU engine's repeated calls: a launch
// bound once, so that repeating it costs a method call instead of a ctypes conversion
// (cpu_loader.CpuKernels.bind), and the check that a call's arrays are a kept call's
// (launch_record.RepeatedCall).
//
//   Bound(entry, arg)        calling it runs  int entry(const void* arg)
//   Bound(entry, arg, n)     calling it runs  int entry(const void* arg, unsigned n)
//
// `entry` and `arg` are addresses (ints); the caller keeps what they point to alive for
// as long as the Bound object lives. A call takes no arguments, releases the GIL while
// the entry runs (ranks that are threads of one process wait for each other inside it)
// and returns the entry's int.
//
//   Arrays(sendbuf, recvbuf) calling it with (a, b) says whether a is sendbuf and b is
//                            recvbuf, both alive (held weakly) with the shape, strides
//                            and dtype they had, and b still writeable
//
// what launch_record.RepeatedCall.matches asks of a later call's arrays, read from the
// arrays' fields (numpy's ndarraytypes.h) instead of their Python attributes. Both must
// be numpy arrays (TypeError otherwise, or where they cannot be weakly referenced).
//
//   Repeats(givens, matchers) calling it with a list of records says whether record i is
//                            the tuple (a, b, *givens[i]), its other arguments the very
//                            objects of givens[i], and matchers[i](a, b) is true
//
// what launch_record.FusedLaunch.repeats asks of a group's calls as given (groups.py).
//
//   Recorder(method, state, scheduler, base, positional, required, keywords)
//                            a Communicator's collective method inside a group: called
//                            with (sendbuf, recvbuf, *args, **kwargs) while state.open
//                            is a group, it appends to open.calls the record `base`
//                            with base[0], base[1] = sendbuf, recvbuf, the positional
//                            args at the indices `positional` (at least `required` of
//                            them) and each keyword at keywords[name], and `scheduler`
//                            to open.schedulers; every other call (no group open, other
//                            arguments) is method(*args, **kwargs), whose answer it is
//
// so that a group records a call as the Python method does (Communicator._collective)
// for a method call's cost; its __wrapped__ is `method` (inspect.signature, help).
//
//   OpenGroup()              a thread's open group (groups.OpenGroup's fields: depth 1,
//                            calls [], schedulers [])
//   GroupScope(state, launch) ``with group():`` (groups._Group): on entry opens a group in
//                            state.open (an OpenGroup) or nests in the open one; on exit
//                            closes a level, and the outermost calls launch(schedulers,
//                            calls) unless an exception is leaving the block
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>  // PyMemberDef, T_PYSSIZET (Python.h leaves it out before 3.12)
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <ndarraytypes.h>  // numpy/ under numpy.get_include(): the folder is on the path (cpu_loader.pycall)

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

PyObject* ndarrayType = nullptr;  // numpy.ndarray, looked up when the module loads

constexpr int kMaxDims = 8;  // arrays of more dimensions are not matched (Arrays refuses them)

// One array as it was: its weak reference, shape, strides and dtype (held).
struct ArrayState {
  PyObject* ref;
  PyObject* descr;
  int nd;
  npy_intp dims[kMaxDims];
  npy_intp strides[kMaxDims];
};

struct Arrays {
  PyObject_HEAD ArrayState send, recv;
  vectorcallfunc vectorcall;
};

int arrayState(ArrayState* st, PyObject* a, const char* what) {
  if (!PyObject_TypeCheck(a, reinterpret_cast<PyTypeObject*>(ndarrayType))) {
    PyErr_Format(PyExc_TypeError, "%s must be a numpy array, got %s", what, Py_TYPE(a)->tp_name);
    return -1;
  }
  PyArrayObject* arr = reinterpret_cast<PyArrayObject*>(a);
  if (PyArray_NDIM(arr) > kMaxDims) {
    PyErr_Format(PyExc_TypeError, "%s has more than %d dimensions", what, kMaxDims);
    return -1;
  }
  st->ref = PyWeakref_NewRef(a, nullptr);  // TypeError where it cannot be weakly referenced
  if (st->ref == nullptr) return -1;
  st->descr = reinterpret_cast<PyObject*>(PyArray_DESCR(arr));
  Py_INCREF(st->descr);
  st->nd = PyArray_NDIM(arr);
  for (int i = 0; i < st->nd; i++) {
    st->dims[i] = PyArray_DIMS(arr)[i];
    st->strides[i] = PyArray_STRIDES(arr)[i];
  }
  return 0;
}

bool sameArray(const ArrayState& st, PyObject* a) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* held = nullptr;
  if (PyWeakref_GetRef(st.ref, &held) < 0) PyErr_Clear();
  Py_XDECREF(held);  // only compared: `a` holds the object alive if it is the one
#else
  PyObject* held = PyWeakref_GET_OBJECT(st.ref);  // Py_None once the array is gone
#endif
  if (held != a) return false;
  PyArrayObject* arr = reinterpret_cast<PyArrayObject*>(a);  // the object that was an ndarray
  if (PyArray_NDIM(arr) != st.nd || reinterpret_cast<PyObject*>(PyArray_DESCR(arr)) != st.descr) return false;
  for (int i = 0; i < st.nd; i++)
    if (PyArray_DIMS(arr)[i] != st.dims[i] || PyArray_STRIDES(arr)[i] != st.strides[i]) return false;
  return true;
}

PyObject* arraysCall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "Arrays(a, b): two arrays, positional");
    return nullptr;
  }
  const Arrays* m = reinterpret_cast<const Arrays*>(self);
  bool same = sameArray(m->send, args[0]) && sameArray(m->recv, args[1]) &&
              (PyArray_FLAGS(reinterpret_cast<PyArrayObject*>(args[1])) & NPY_ARRAY_WRITEABLE);
  return PyBool_FromLong(same);
}

int arraysInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject *send = nullptr, *recv = nullptr;
  static const char* names[] = {"sendbuf", "recvbuf", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", const_cast<char**>(names), &send, &recv)) return -1;
  Arrays* m = reinterpret_cast<Arrays*>(self);
  if (m->send.ref != nullptr) {
    PyErr_SetString(PyExc_TypeError, "Arrays is initialized once");
    return -1;
  }
  if (arrayState(&m->send, send, "sendbuf") < 0 || arrayState(&m->recv, recv, "recvbuf") < 0) return -1;
  m->vectorcall = arraysCall;
  return 0;
}

void arraysDealloc(PyObject* self) {
  Arrays* m = reinterpret_cast<Arrays*>(self);
  Py_XDECREF(m->send.ref);
  Py_XDECREF(m->send.descr);
  Py_XDECREF(m->recv.ref);
  Py_XDECREF(m->recv.descr);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject ArraysType = {PyVarObject_HEAD_INIT(nullptr, 0)};

struct Repeats {
  PyObject_HEAD PyObject* givens;  // a tuple of tuples
  PyObject* matchers;              // a tuple of callables, as many
  vectorcallfunc vectorcall;
};

bool repeatsOne(PyObject* record, PyObject* given, PyObject* matcher, int* failed) {
  if (!PyTuple_CheckExact(record)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(given);
  if (PyTuple_GET_SIZE(record) != n + 2) return false;
  for (Py_ssize_t j = 0; j < n; j++)
    if (PyTuple_GET_ITEM(record, j + 2) != PyTuple_GET_ITEM(given, j)) return false;
  PyObject* arrays[2] = {PyTuple_GET_ITEM(record, 0), PyTuple_GET_ITEM(record, 1)};
  PyObject* same = PyObject_Vectorcall(matcher, arrays, 2, nullptr);
  if (same == nullptr) {
    *failed = 1;
    return false;
  }
  const bool yes = same == Py_True;
  Py_DECREF(same);
  return yes;
}

PyObject* repeatsCall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "Repeats(records): one list, positional");
    return nullptr;
  }
  const Repeats* r = reinterpret_cast<const Repeats*>(self);
  PyObject* records = args[0];
  if (!PyList_CheckExact(records)) {
    PyErr_SetString(PyExc_TypeError, "Repeats(records): records must be a list");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(r->givens);
  if (PyList_GET_SIZE(records) != n) Py_RETURN_FALSE;
  int failed = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    // The list holds its items while the matcher runs: nothing here can change it.
    if (!repeatsOne(PyList_GET_ITEM(records, i), PyTuple_GET_ITEM(r->givens, i), PyTuple_GET_ITEM(r->matchers, i),
                    &failed)) {
      if (failed) return nullptr;
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

int repeatsInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject *givens = nullptr, *matchers = nullptr;
  static const char* names[] = {"givens", "matchers", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", const_cast<char**>(names), &givens, &matchers)) return -1;
  Repeats* r = reinterpret_cast<Repeats*>(self);
  if (r->givens != nullptr) {
    PyErr_SetString(PyExc_TypeError, "Repeats is initialized once");
    return -1;
  }
  PyObject* g = PySequence_Tuple(givens);
  PyObject* m = g == nullptr ? nullptr : PySequence_Tuple(matchers);
  if (m == nullptr || PyTuple_GET_SIZE(g) != PyTuple_GET_SIZE(m)) {
    if (m != nullptr) PyErr_SetString(PyExc_ValueError, "Repeats: as many matchers as givens");
    Py_XDECREF(g);
    Py_XDECREF(m);
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g); i++) {
    if (!PyTuple_Check(PyTuple_GET_ITEM(g, i)) || !PyCallable_Check(PyTuple_GET_ITEM(m, i))) {
      PyErr_SetString(PyExc_TypeError, "Repeats: each given a tuple, each matcher callable");
      Py_DECREF(g);
      Py_DECREF(m);
      return -1;
    }
  }
  r->givens = g;
  r->matchers = m;
  r->vectorcall = repeatsCall;
  return 0;
}

void repeatsDealloc(PyObject* self) {
  Repeats* r = reinterpret_cast<Repeats*>(self);
  Py_XDECREF(r->givens);
  Py_XDECREF(r->matchers);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject RepeatsType = {PyVarObject_HEAD_INIT(nullptr, 0)};

struct Recorder {
  PyObject_HEAD PyObject* method;  // the Python method: every call that is not recorded here
  PyObject* state;                 // groups.state: its `open` is the thread's group, or None
  PyObject* scheduler;
  PyObject* base;      // a tuple: the record with the defaults
  PyObject* keywords;  // a dict: keyword name -> index in the record
  Py_ssize_t positional[4];
  Py_ssize_t npositional, required;
  vectorcallfunc vectorcall;
};

PyObject* openName = nullptr;  // "open", "calls", "schedulers": interned when the module loads
PyObject* callsName = nullptr;
PyObject* schedulersName = nullptr;

// Appends the record of (args, kwnames) to the thread's group: 1, 0 where the method
// must answer the call instead, -1 on an error.
int recordCall(const Recorder* r, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (nargs < 2 + r->required || nargs > 2 + r->npositional) return 0;
  PyObject* open = PyObject_GetAttr(r->state, openName);
  if (open == nullptr) return -1;
  if (open == Py_None) {
    Py_DECREF(open);
    return 0;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(r->base);
  PyObject* record = PyTuple_New(n);
  if (record == nullptr) {
    Py_DECREF(open);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(record, i, Py_NewRef(PyTuple_GET_ITEM(r->base, i)));
  auto put = [record](Py_ssize_t at, PyObject* value) {
    PyObject* old = PyTuple_GET_ITEM(record, at);
    PyTuple_SET_ITEM(record, at, Py_NewRef(value));
    Py_DECREF(old);
  };
  put(0, args[0]);
  put(1, args[1]);
  for (Py_ssize_t i = 2; i < nargs; i++) put(r->positional[i - 2], args[i]);
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  int status = 1;
  for (Py_ssize_t k = 0; k < nkw && status == 1; k++) {
    PyObject* at = PyDict_GetItemWithError(r->keywords, PyTuple_GET_ITEM(kwnames, k));  // borrowed
    if (at == nullptr) {
      status = PyErr_Occurred() ? -1 : 0;
      break;
    }
    const Py_ssize_t i = PyLong_AsSsize_t(at);
    for (Py_ssize_t j = 0; j < nargs - 2; j++)
      if (r->positional[j] == i) status = 0;  // given twice: the method says so
    if (status == 1) put(i, args[nargs + k]);
  }
  if (status == 1) {
    PyObject* calls = PyObject_GetAttr(open, callsName);
    PyObject* schedulers = calls == nullptr ? nullptr : PyObject_GetAttr(open, schedulersName);
    if (schedulers == nullptr || !PyList_Check(calls) || !PyList_Check(schedulers)) {
      if (schedulers != nullptr) PyErr_SetString(PyExc_TypeError, "Recorder: a group's calls and schedulers are lists");
      status = -1;
    } else if (PyList_Append(calls, record) < 0) {
      status = -1;
    } else if (PyList_Append(schedulers, r->scheduler) < 0) {  // undone: the two lists stay as long as each other
      PyList_SetSlice(calls, PyList_GET_SIZE(calls) - 1, PyList_GET_SIZE(calls), nullptr);
      status = -1;
    }
    Py_XDECREF(calls);
    Py_XDECREF(schedulers);
  }
  Py_DECREF(record);
  Py_DECREF(open);
  return status;
}

PyObject* recorderCall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Recorder* r = reinterpret_cast<const Recorder*>(self);
  const int recorded = recordCall(r, args, PyVectorcall_NARGS(nargsf), kwnames);
  if (recorded < 0) return nullptr;
  if (recorded) Py_RETURN_NONE;
  return PyObject_Vectorcall(r->method, args, nargsf, kwnames);
}

int recorderInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject *method, *state, *scheduler, *base, *positional, *keywords;
  Py_ssize_t required;
  static const char* names[] = {"method", "state", "scheduler", "base", "positional", "required", "keywords", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!O!nO!", const_cast<char**>(names), &method, &state, &scheduler,
                                   &PyTuple_Type, &base, &PyTuple_Type, &positional, &required, &PyDict_Type,
                                   &keywords))
    return -1;
  Recorder* r = reinterpret_cast<Recorder*>(self);
  if (r->method != nullptr) {
    PyErr_SetString(PyExc_TypeError, "Recorder is initialized once");
    return -1;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(base), np = PyTuple_GET_SIZE(positional);
  if (!PyCallable_Check(method) || n < 2 || np > 4 || required < 0 || required > np) {
    PyErr_SetString(PyExc_ValueError, "Recorder: a callable, a record of two buffers and more, at most 4 positional");
    return -1;
  }
  for (Py_ssize_t i = 0; i < np; i++) {
    r->positional[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(positional, i));
    if (r->positional[i] < 2 || r->positional[i] >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Recorder: a positional index past the buffers");
      return -1;
    }
  }
  PyObject *name, *at;
  Py_ssize_t pos = 0;
  while (PyDict_Next(keywords, &pos, &name, &at)) {
    const Py_ssize_t i = PyLong_Check(at) ? PyLong_AsSsize_t(at) : -1;
    if (!PyUnicode_Check(name) || i < 2 || i >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Recorder: keywords name indices past the buffers");
      return -1;
    }
  }
  r->npositional = np;
  r->required = required;
  r->method = Py_NewRef(method);
  r->state = Py_NewRef(state);
  r->scheduler = Py_NewRef(scheduler);
  r->base = Py_NewRef(base);
  r->keywords = Py_NewRef(keywords);
  r->vectorcall = recorderCall;
  return 0;
}

int recorderTraverse(PyObject* self, visitproc visit, void* arg) {
  Recorder* r = reinterpret_cast<Recorder*>(self);
  Py_VISIT(r->method);
  Py_VISIT(r->state);
  Py_VISIT(r->scheduler);
  Py_VISIT(r->base);
  Py_VISIT(r->keywords);
  return 0;
}

int recorderClear(PyObject* self) {
  Recorder* r = reinterpret_cast<Recorder*>(self);
  Py_CLEAR(r->method);
  Py_CLEAR(r->state);
  Py_CLEAR(r->scheduler);
  Py_CLEAR(r->base);
  Py_CLEAR(r->keywords);
  return 0;
}

// The dealloc of this module's types that hold Python objects: untracked, their tp_clear, freed.
void holderDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  Py_TYPE(self)->tp_clear(self);
  Py_TYPE(self)->tp_free(self);
}

// __wrapped__, __doc__, __name__: the method's (inspect.signature and help read them).
PyObject* recorderWrapped(PyObject* self, void*) {
  PyObject* m = reinterpret_cast<Recorder*>(self)->method;
  if (m == nullptr) Py_RETURN_NONE;
  return Py_NewRef(m);
}

PyObject* recorderMethodAttr(PyObject* self, void* name) {
  PyObject* m = reinterpret_cast<Recorder*>(self)->method;
  if (m == nullptr) Py_RETURN_NONE;
  return PyObject_GetAttrString(m, static_cast<const char*>(name));
}

PyGetSetDef recorderGetset[] = {
    {"__wrapped__", recorderWrapped, nullptr, "the method that answers every call not recorded", nullptr},
    {"__doc__", recorderMethodAttr, nullptr, nullptr, const_cast<char*>("__doc__")},
    {"__name__", recorderMethodAttr, nullptr, nullptr, const_cast<char*>("__name__")},
    {"__qualname__", recorderMethodAttr, nullptr, nullptr, const_cast<char*>("__qualname__")},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject RecorderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

struct OpenGroup {
  PyObject_HEAD Py_ssize_t depth;
  PyObject* calls;
  PyObject* schedulers;
};

PyTypeObject OpenGroupType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* openGroupNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if ((args != nullptr && PyTuple_GET_SIZE(args) != 0) || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "OpenGroup() takes no arguments");
    return nullptr;
  }
  OpenGroup* g = reinterpret_cast<OpenGroup*>(type->tp_alloc(type, 0));
  if (g == nullptr) return nullptr;
  g->depth = 1;
  g->calls = PyList_New(0);
  g->schedulers = PyList_New(0);
  if (g->calls == nullptr || g->schedulers == nullptr) {
    Py_DECREF(g);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(g);
}

int openGroupTraverse(PyObject* self, visitproc visit, void* arg) {
  OpenGroup* g = reinterpret_cast<OpenGroup*>(self);
  Py_VISIT(g->calls);
  Py_VISIT(g->schedulers);
  return 0;
}

int openGroupClear(PyObject* self) {
  OpenGroup* g = reinterpret_cast<OpenGroup*>(self);
  Py_CLEAR(g->calls);
  Py_CLEAR(g->schedulers);
  return 0;
}

PyMemberDef openGroupMembers[] = {
    {"depth", T_PYSSIZET, offsetof(OpenGroup, depth), 0, "nesting depth (> 0)"},
    {"calls", T_OBJECT_EX, offsetof(OpenGroup, calls), 0, "the members, in call order"},
    {"schedulers", T_OBJECT_EX, offsetof(OpenGroup, schedulers), 0, "the scheduler of each member"},
    {nullptr, 0, 0, 0, nullptr}};

struct GroupScope {
  PyObject_HEAD PyObject* state;  // groups.state
  PyObject* launch;               // groups.launch(schedulers, calls)
};

PyObject* depthName = nullptr;  // "depth": interned when the module loads

// Adds `by` to the depth of a group that is not an OpenGroup of this module (groups.py's
// own): its new depth, or -1 on an error.
Py_ssize_t addDepth(PyObject* open, long by) {
  if (Py_TYPE(open) == &OpenGroupType) return reinterpret_cast<OpenGroup*>(open)->depth += by;
  PyObject* depth = PyObject_GetAttr(open, depthName);
  if (depth == nullptr) return -1;
  const Py_ssize_t d = PyLong_AsSsize_t(depth);
  Py_DECREF(depth);
  if (d == -1 && PyErr_Occurred()) return -1;
  PyObject* now = PyLong_FromSsize_t(d + by);
  const int failed = now == nullptr || PyObject_SetAttr(open, depthName, now) < 0;
  Py_XDECREF(now);
  return failed ? -1 : d + by;
}

PyObject* scopeEnter(PyObject* self, PyObject*) {
  GroupScope* sc = reinterpret_cast<GroupScope*>(self);
  PyObject* open = PyObject_GetAttr(sc->state, openName);
  if (open == nullptr) return nullptr;
  int failed;
  if (open == Py_None) {
    PyObject* g = openGroupNew(&OpenGroupType, nullptr, nullptr);
    failed = g == nullptr || PyObject_SetAttr(sc->state, openName, g) < 0;
    Py_XDECREF(g);
  } else {
    failed = addDepth(open, 1) < 0;
  }
  Py_DECREF(open);
  if (failed) return nullptr;
  Py_RETURN_NONE;
}
PyObject* scopeExit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "__exit__(exc_type, exc, tb)");
    return nullptr;
  }
  GroupScope* sc = reinterpret_cast<GroupScope*>(self);
  PyObject* open = PyObject_GetAttr(sc->state, openName);
  if (open == nullptr) return nullptr;
  if (open == Py_None) {
    Py_DECREF(open);
    PyErr_SetString(PyExc_RuntimeError, "group_end() without a matching group_start()");
    return nullptr;
  }
  const Py_ssize_t depth = addDepth(open, -1);
  PyObject* out = nullptr;
  if (depth > 0) {
    out = Py_NewRef(Py_None);
  } else if (depth == 0 && PyObject_SetAttr(sc->state, openName, Py_None) == 0) {
    if (args[0] != Py_None) {  // an exception leaves the block: nothing launches
      out = Py_NewRef(Py_None);
    } else {
      PyObject* calls = PyObject_GetAttr(open, callsName);
      PyObject* schedulers = calls == nullptr ? nullptr : PyObject_GetAttr(open, schedulersName);
      if (schedulers != nullptr) {
        PyObject* launchArgs[2] = {schedulers, calls};
        out = PyObject_Vectorcall(sc->launch, launchArgs, 2, nullptr);
      }
      Py_XDECREF(calls);
      Py_XDECREF(schedulers);
    }
  }
  Py_DECREF(open);
  if (out == nullptr) return nullptr;
  Py_DECREF(out);
  Py_RETURN_NONE;  // falsy: an exception leaving the block goes on
}

int scopeInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject *state, *launch;
  static const char* names[] = {"state", "launch", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", const_cast<char**>(names), &state, &launch)) return -1;
  GroupScope* sc = reinterpret_cast<GroupScope*>(self);
  if (sc->state != nullptr) {
    PyErr_SetString(PyExc_TypeError, "GroupScope is initialized once");
    return -1;
  }
  if (!PyCallable_Check(launch)) {
    PyErr_SetString(PyExc_TypeError, "GroupScope: launch must be callable");
    return -1;
  }
  sc->state = Py_NewRef(state);
  sc->launch = Py_NewRef(launch);
  return 0;
}

int scopeTraverse(PyObject* self, visitproc visit, void* arg) {
  GroupScope* sc = reinterpret_cast<GroupScope*>(self);
  Py_VISIT(sc->state);
  Py_VISIT(sc->launch);
  return 0;
}

int scopeClear(PyObject* self) {
  GroupScope* sc = reinterpret_cast<GroupScope*>(self);
  Py_CLEAR(sc->state);
  Py_CLEAR(sc->launch);
  return 0;
}

PyMethodDef scopeMethods[] = {
    {"__enter__", scopeEnter, METH_NOARGS, "opens a group, or nests in the open one"},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(scopeExit)), METH_FASTCALL,
     "closes a level; the outermost launches the group unless an exception is leaving"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject GroupScopeType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyModuleDef module = {PyModuleDef_HEAD_INIT, "commref_pycall",
                      "The CPU engine's repeated calls: bound launches, kept arrays, repeated groups, recorded calls.",
                      -1};

// A callable type of this module: made with (args) by `init`, called through the
// vectorcall slot at `vectorcallOffset`.
int readyType(PyTypeObject& t, const char* name, Py_ssize_t size, initproc init, destructor dealloc,
              Py_ssize_t vectorcallOffset, const char* doc) {
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_flags |= Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;  // and any flag set before
  t.tp_new = PyType_GenericNew;
  t.tp_init = init;
  if (dealloc != nullptr) t.tp_dealloc = dealloc;
  t.tp_call = PyVectorcall_Call;
  t.tp_vectorcall_offset = vectorcallOffset;
  t.tp_doc = doc;
  return PyType_Ready(&t);
}

// A type of this module, not callable, whose objects hold Python objects (the cyclic
// collector's: traverse, clear; holderDealloc), made ready; tp_new PyType_GenericNew
// unless set before.
int readyHolderType(PyTypeObject& t, const char* name, Py_ssize_t size, traverseproc traverse, inquiry clear,
                    const char* doc) {
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_flags |= Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  if (t.tp_new == nullptr) t.tp_new = PyType_GenericNew;
  t.tp_traverse = traverse;
  t.tp_clear = clear;
  t.tp_dealloc = holderDealloc;
  t.tp_doc = doc;
  return PyType_Ready(&t);
}

}  // namespace

PyMODINIT_FUNC PyInit_commref_pycall() {
  if (readyType(BoundType, "commref_pycall.Bound", sizeof(Bound), boundInit, nullptr, offsetof(Bound, vectorcall),
                "Bound(entry, arg[, n]): calling it runs entry(arg) or entry(arg, n) without the GIL.") < 0 ||
      readyType(
          ArraysType, "commref_pycall.Arrays", sizeof(Arrays), arraysInit, arraysDealloc, offsetof(Arrays, vectorcall),
          "Arrays(sendbuf, recvbuf): calling it with (a, b) says whether they are those arrays, unchanged.") < 0 ||
      readyType(RepeatsType, "commref_pycall.Repeats", sizeof(Repeats), repeatsInit, repeatsDealloc,
                offsetof(Repeats, vectorcall),
                "Repeats(givens, matchers): calling it with records says whether they repeat those calls.") < 0)
    return nullptr;
  RecorderType.tp_flags |= Py_TPFLAGS_HAVE_GC;  // it holds the method, whose communicator holds it
  RecorderType.tp_traverse = recorderTraverse;
  RecorderType.tp_clear = recorderClear;
  RecorderType.tp_getset = recorderGetset;
  if (readyType(RecorderType, "commref_pycall.Recorder", sizeof(Recorder), recorderInit, holderDealloc,
                offsetof(Recorder, vectorcall),
                "Recorder(method, state, scheduler, base, positional, required, keywords): a collective method "
                "that records its calls in a group.") < 0)
    return nullptr;
  OpenGroupType.tp_new = openGroupNew;
  OpenGroupType.tp_members = openGroupMembers;
  GroupScopeType.tp_init = scopeInit;
  GroupScopeType.tp_methods = scopeMethods;
  if (readyHolderType(OpenGroupType, "commref_pycall.OpenGroup", sizeof(OpenGroup), openGroupTraverse, openGroupClear,
                      "OpenGroup(): a thread's open group (groups.OpenGroup's fields).") < 0 ||
      readyHolderType(GroupScopeType, "commref_pycall.GroupScope", sizeof(GroupScope), scopeTraverse, scopeClear,
                      "GroupScope(state, launch): with group(): a group of this thread's calls.") < 0)
    return nullptr;
  depthName = PyUnicode_InternFromString("depth");
  if (depthName == nullptr) return nullptr;
  openName = PyUnicode_InternFromString("open");
  callsName = PyUnicode_InternFromString("calls");
  schedulersName = PyUnicode_InternFromString("schedulers");
  if (openName == nullptr || callsName == nullptr || schedulersName == nullptr) return nullptr;
  PyObject* numpy = PyImport_ImportModule("numpy");
  if (numpy == nullptr) return nullptr;
  ndarrayType = PyObject_GetAttrString(numpy, "ndarray");
  Py_DECREF(numpy);
  if (ndarrayType == nullptr) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&BoundType);
  Py_INCREF(&ArraysType);
  Py_INCREF(&RepeatsType);
  Py_INCREF(&RecorderType);
  Py_INCREF(&OpenGroupType);
  Py_INCREF(&GroupScopeType);
  if (PyModule_AddObject(m, "Bound", reinterpret_cast<PyObject*>(&BoundType)) < 0 ||
      PyModule_AddObject(m, "Arrays", reinterpret_cast<PyObject*>(&ArraysType)) < 0 ||
      PyModule_AddObject(m, "Repeats", reinterpret_cast<PyObject*>(&RepeatsType)) < 0 ||
      PyModule_AddObject(m, "Recorder", reinterpret_cast<PyObject*>(&RecorderType)) < 0 ||
      PyModule_AddObject(m, "OpenGroup", reinterpret_cast<PyObject*>(&OpenGroupType)) < 0 ||
      PyModule_AddObject(m, "GroupScope", reinterpret_cast<PyObject*>(&GroupScopeType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
