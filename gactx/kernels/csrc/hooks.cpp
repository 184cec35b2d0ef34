// The saved-tensor hooks' own calls in C++ (gactx/controller/lane.py): HookGraph.__call__ (compiled.py), which picks
// the traced, TorchDynamo or eager work of a hook, and the unpack hook's eager work (store.unpack). With the pack lane
// (lane.cpp), no Python frame of gactx's runs for a save the lane takes.
#include <torch/python.h>

#include <torch/csrc/autograd/python_variable.h>

namespace gactx {

namespace py = pybind11;

namespace {

// store.unpack: a tensor as it is, a store.Kept's tensor at its version (``kept``, this function's self), else
// ``handle.unpack()`` (a Kept changed in place raises there).
PyObject* unpack_call(PyObject* kept, PyObject* handle) {
  if (THPVariable_Check(handle)) {
    Py_INCREF(handle);
    return handle;
  }
  static PyObject* unpack_name = PyUnicode_InternFromString("unpack");
  static PyObject* tensor_name = PyUnicode_InternFromString("tensor");
  static PyObject* version_name = PyUnicode_InternFromString("version");
  if (Py_TYPE(handle) == reinterpret_cast<PyTypeObject*>(kept)) {
    PyObject* tensor = PyObject_GetAttr(handle, tensor_name);
    PyObject* version = tensor == nullptr ? nullptr : PyObject_GetAttr(handle, version_name);
    if (version != nullptr && THPVariable_Check(tensor)) {
      const long long at = PyLong_AsLongLong(version);
      if (!(at == -1 && PyErr_Occurred()) && THPVariable_Unpack(tensor)._version() == at) {
        Py_DECREF(version);
        return tensor;
      }
    }
    Py_XDECREF(tensor);
    Py_XDECREF(version);
    if (PyErr_Occurred()) return nullptr;
  }
  return PyObject_CallMethodNoArgs(handle, unpack_name);
}

// HookGraph.__call__ (compiled.py) for one hook: ``compiled(x)`` while AOTAutograd traces it (the state of
// ``local``, a threading.local, set), ``disabled(x)`` where TorchDynamo intercepts frames (``frame_callback()`` not
// None), else ``eager(x)``: each read from the hook's instance dict at the call (a benchmark may swap ``eager``).
struct Dispatch {
  py::object hook_ref, local, frame_callback;
};

PyObject* dispatch_call(PyObject* self, PyObject* x) {
  try {
    auto* d = static_cast<Dispatch*>(PyCapsule_GetPointer(self, "gactx.Dispatch"));
    static PyObject* dict_name = PyUnicode_InternFromString("__dict__");
    static PyObject* state_name = PyUnicode_InternFromString("state");
    static PyObject* compiled_name = PyUnicode_InternFromString("compiled");
    static PyObject* disabled_name = PyUnicode_InternFromString("disabled");
    static PyObject* eager_name = PyUnicode_InternFromString("eager");
    PyObject* hook = PyWeakref_GetObject(d->hook_ref.ptr());
    if (hook == Py_None) {
      PyErr_SetString(PyExc_RuntimeError, "gactx: a saved-tensor hook that was freed");
      return nullptr;
    }
    py::object local = py::reinterpret_steal<py::object>(PyObject_GetAttr(d->local.ptr(), dict_name));
    if (!local) return nullptr;
    PyObject* state = PyDict_GetItemWithError(local.ptr(), state_name);
    if (state == nullptr && PyErr_Occurred()) return nullptr;
    PyObject* name = eager_name;
    if (state != nullptr && state != Py_None) {
      name = compiled_name;
    } else {
      py::object callback = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(d->frame_callback.ptr()));
      if (!callback) return nullptr;
      if (!callback.is_none()) name = disabled_name;
    }
    py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(hook, nullptr));
    if (!dict) return nullptr;
    PyObject* fn = PyDict_GetItemWithError(dict.ptr(), name);
    if (fn == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
      return nullptr;
    }
    return PyObject_CallOneArg(fn, x);
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyMethodDef dispatch_def{"hook_call", dispatch_call, METH_O, "HookGraph.__call__ (compiled.py)"};

PyMethodDef unpack_def{"unpack", unpack_call, METH_O, "the unpack hook's eager work (store.unpack)"};

}  // namespace

py::object make_dispatch(py::object hook, py::object local, py::object frame_callback) {
  auto* d = new Dispatch{py::reinterpret_steal<py::object>(PyWeakref_NewRef(hook.ptr(), nullptr)), local, frame_callback};
  if (!d->hook_ref) {
    delete d;
    throw py::error_already_set();
  }
  py::capsule capsule(d, "gactx.Dispatch", [](PyObject* c) {
    delete static_cast<Dispatch*>(PyCapsule_GetPointer(c, "gactx.Dispatch"));
  });
  PyObject* fn = PyCFunction_New(&dispatch_def, capsule.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

py::object make_unpack(py::object kept) {
  PyObject* fn = PyCFunction_New(&unpack_def, kept.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace gactx
