// The pack hook's lane for saves whose keys go by position (gactx/controller/pack.py, PackPath._by_position): the same
// steps in C++, read from the same Python objects, with no Python frame. A save it cannot take whole goes to the Python
// path (``PackPath.pack``), which takes it from the start; nothing is changed before the lane knows it takes the save.
//
// Followed step by step, as PackPath.pack, PackPath._by_position, ModuleTracker.at_position and
// PassStats.record_replayed do it:
//   1. the pass under way goes by position: no compiled graph's log to read first, no watched pass, no backward
//      running, keys by position, no observers (the pass's first save begins its statistics, as the Python path does);
//   2. a parameter (its storage the model's; a leaf, or a view or copy of a leaf, that is one: policy.is_weight) is
//      kept with its version (store.Kept);
//   3. the save at the pass's position matches: shape, dtype, node, call site (positions.Trace.at);
//   4. its key was replayed with a C++ packer of its own, no later save shares it, no probe or checkpointed input,
//      its storage new to the pass, its record the one to repeat (the same storage number and bytes);
//   5. stored (the packer, the step's seed), recorded (the storage, the record, the counts), a result's node claimed,
//      the position passed.
#include <torch/python.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <frameobject.h>

#include <atomic>
#include <chrono>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "saved.h"

namespace gactx {

namespace py = pybind11;

namespace {

// Interned names of the attributes the lane reads (made once, never freed).
struct Names {
  PyObject *before_save, *watching, *fresh, *by_position, *observers, *stats, *ptrs, *stack, *position, *trace, *saves,
      *replays, *native, *shared, *node, *dtype, *measured, *inputs, *live, *record, *storage, *storage_bytes,
      *packed_bytes, *storages, *kept_ranges, *records, *original_bytes, *compressed, *weyl, *plan, *seed_base,
      *claims, *claimed, *name, *begin_pass, *model_storages, *tensor, *version, *is_param;
  Names() {
    auto n = [](const char* s) { return PyUnicode_InternFromString(s); };
    before_save = n("before_save"), watching = n("watching"), fresh = n("fresh"), by_position = n("by_position");
    observers = n("observers"), stats = n("stats"), ptrs = n("_ptrs"), stack = n("_stack"), position = n("_position");
    trace = n("_trace"), saves = n("saves"), replays = n("replays"), native = n("native"), shared = n("shared");
    node = n("node"), dtype = n("dtype"), measured = n("_measured"), inputs = n("inputs"), live = n("live");
    record = n("record"), storage = n("storage"), storage_bytes = n("storage_bytes"), packed_bytes = n("packed_bytes");
    storages = n("storages"), kept_ranges = n("kept_ranges"), records = n("records"), original_bytes = n("original_bytes");
    compressed = n("compressed"), weyl = n("weyl"), plan = n("_plan"), seed_base = n("seed_base"), claims = n("claims");
    claimed = n("_claimed"), name = n("__name__"), begin_pass = n("begin_pass_if_fresh");
    model_storages = n("_model_storages"), tensor = n("tensor"), version = n("version"), is_param = n("_is_param");
  }
};

const Names& names() {
  static const Names* made = new Names();
  return *made;
}

constexpr uint64_t kMask62 = (uint64_t(1) << 62) - 1;

// The packers' time inside lanes while timing is on (benchmarks.host: the lane's kernels, which no Python wrapper sees).
std::atomic<bool> timing{false};
std::atomic<int64_t> timed_ns{0};

// A new reference, or an error raised (an attribute the Python side always has).
py::object attr(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// A borrowed item of an instance's __dict__ (nullptr where missing).
inline PyObject* item(PyObject* dict, PyObject* name) { return PyDict_GetItemWithError(dict, name); }

int64_t as_int(PyObject* o) {
  const int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

void add_to(PyObject* dict, PyObject* name, int64_t delta) {
  PyObject* now = item(dict, name);
  if (now == nullptr) throw py::error_already_set();
  py::object sum = py::reinterpret_steal<py::object>(PyLong_FromLongLong(as_int(now) + delta));
  if (PyDict_SetItem(dict, name, sum.ptr()) < 0) throw py::error_already_set();
}

// What a node of a class is to policy.is_weight (Lane::kind_of).
enum Kind { kUnjudged = -1, kOther = 0, kView, kCopy, kAccumulate };

// An autograd node's pointer as this torch holds one (a shared or an intrusive pointer, by version).
using NodePtr = std::decay_t<decltype(torch::autograd::Edge().function)>;

struct Lane {
  // The pack path and its tracker, weakly (the tracker calls up into the controller, which holds the hooks: a strong
  // reference from here would make a cycle the collector cannot see through the capsule), and their own dicts,
  // read while they live.
  py::object path_ref, tracker_ref, kept, saving, view_names, passing, parameter;
  PyObject *path_dict = nullptr, *tracker_dict = nullptr;
  std::vector<PyObject*> passing_codes;  // the code objects that pass saves on (identity.passes_saves_on), by identity
  Py_ssize_t passing_size = -1;
  int precall = -1, precall_to_call = 0;  // positions.PRECALL and PRECALL_TO_CALL (-1: no PRECALL)
  std::unordered_map<PyTypeObject*, Kind> kinds;  // node class -> its Kind (static classes only)

  // The code objects of ``passing`` (a set that grows as modules are imported), read again when it grew.
  void read_passing() {
    const Py_ssize_t size = PySet_GET_SIZE(passing.ptr());
    if (size == passing_size) return;
    passing_codes.clear();
    for (py::handle code : passing) passing_codes.push_back(code.ptr());
    passing_size = size;
  }

  bool passes_on(PyObject* code) const {
    for (PyObject* c : passing_codes)
      if (c == code) return true;
    return false;
  }

  // Whether the frame that ran the op saving now is ``code`` at ``lasti`` (positions.call_site: the first frame
  // outside those that pass saves on).
  bool called_at(PyObject* code, PyObject* lasti) {
#if PY_VERSION_HEX < 0x030B0000
    return false;  // no PyFrame_GetLasti: every save goes the Python way (lane.py makes no lane there)
#else
    read_passing();
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    while (frame != nullptr) {
      PyCodeObject* c = PyFrame_GetCode(frame);
      const bool passing_on = passes_on(reinterpret_cast<PyObject*>(c));
      if (!passing_on) {
        int instruction = PyFrame_GetLasti(frame);
        if (precall >= 0 && reinterpret_cast<PyObject*>(c) == code) {  // positions.PRECALL: read as its CALL
          PyObject* bytes = PyCode_GetCode(c);
          if (bytes == nullptr) throw py::error_already_set();
          if (instruction >= 0 && instruction < PyBytes_GET_SIZE(bytes) &&
              static_cast<unsigned char>(PyBytes_AS_STRING(bytes)[instruction]) == precall)
            instruction += precall_to_call;
          Py_DECREF(bytes);
        }
        const bool same = reinterpret_cast<PyObject*>(c) == code && instruction == as_int(lasti);
        Py_DECREF(c);
        Py_DECREF(frame);
        return same;
      }
      Py_DECREF(c);
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    return code == Py_None && as_int(lasti) == -1;
#endif
  }

  // What a node of this class is to policy.is_weight: a view's (policy._VIEW_NODES), a copy's (ToCopyBackward0), a
  // leaf's gradient accumulator, or another op's; kUnjudged for a class made in Python (it may be freed and its
  // address reused).
  Kind kind_of(PyTypeObject* type) {
    if (type->tp_flags & Py_TPFLAGS_HEAPTYPE) return kUnjudged;
    auto found = kinds.find(type);
    if (found != kinds.end()) return found->second;
    py::object name = attr(reinterpret_cast<PyObject*>(type), names().name);
    const int view = PySet_Contains(view_names.ptr(), name.ptr());
    if (view < 0) throw py::error_already_set();
    const std::string text = name.cast<std::string>();
    const Kind kind = view ? kView : text == "ToCopyBackward0" ? kCopy : text == "AccumulateGrad" ? kAccumulate : kOther;
    kinds.emplace(type, kind);
    return kind;
  }

  Kind kind_of(const NodePtr& fn) {
    py::object node = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(fn));
    if (!node) throw py::error_already_set();
    return kind_of(Py_TYPE(node.ptr()));
  }

  // policy.is_weight_copy: a view (a few deep) of a copy of a leaf that requires grad (an autocast weight): 1, 0, or
  // -1 where a node on the way is one the lane does not judge.
  int weight_copy(const NodePtr& fn) {
    auto node = fn;
    for (int i = 0; i < 4; ++i) {
      if (!node) break;
      const Kind kind = kind_of(node);
      if (kind == kUnjudged) return -1;
      if (kind != kView) break;
      node = node->next_edges().empty() ? nullptr : node->next_edge(0).function;
    }
    if (!node) return 0;
    const Kind kind = kind_of(node);
    if (kind != kCopy) return kind == kUnjudged ? -1 : 0;
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      const Kind next = kind_of(edge.function);
      if (next == kUnjudged) return -1;
      if (next == kAccumulate) return 1;
    }
    return 0;
  }

  // The handle of the save of ``obj``, or nullptr where the Python path takes it (no error set).
  PyObject* take(PyObject* path, PyObject* obj);

  // store.Kept(tensor, version), made without its __init__ (a Python frame).
  PyObject* kept_handle(PyObject* tensor, int64_t version) {
    auto* type = reinterpret_cast<PyTypeObject*>(kept.ptr());
    py::object handle = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
    py::object at = py::reinterpret_steal<py::object>(PyLong_FromLongLong(version));
    if (!handle || !at || PyObject_SetAttr(handle.ptr(), names().tensor, tensor) < 0 ||
        PyObject_SetAttr(handle.ptr(), names().version, at.ptr()) < 0)
      throw py::error_already_set();
    return handle.release().ptr();
  }

  // Whether ``obj`` (``t``), or the base it views, is a parameter (policy.is_weight's owner test): 1 or 0.
  int is_parameter(PyObject* obj, const at::Tensor& t) {
    py::object base;
    PyObject* owner = obj;
    if (t.is_view()) {
      base = py::reinterpret_steal<py::object>(THPVariable_Wrap(t._base()));
      owner = base.ptr();
    }
    if (THPVariable_CheckExact(owner)) {
      PyObject* flag = PyObject_GetAttr(owner, names().is_param);
      if (flag == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
        PyErr_Clear();
        return 0;
      }
      const int set = PyObject_IsTrue(flag);
      Py_DECREF(flag);
      if (set < 0) throw py::error_already_set();
      return set;
    }
    const int instance = PyObject_IsInstance(owner, parameter.ptr());
    if (instance < 0) throw py::error_already_set();
    return instance;
  }

  PyObject* call(PyObject* obj) {
    PyObject* path = PyWeakref_GetObject(path_ref.ptr());
    if (path == Py_None || PyWeakref_GetObject(tracker_ref.ptr()) == Py_None) {
      PyErr_SetString(PyExc_RuntimeError, "gactx: a saved-tensor hook of a Controller that was freed");
      return nullptr;
    }
    PyObject* handle = take(path, obj);
    if (handle != nullptr || PyErr_Occurred()) return handle;
    static PyObject* pack_name = PyUnicode_InternFromString("pack");
    return PyObject_CallMethodOneArg(path, pack_name, obj);
  }
};

PyObject* Lane::take(PyObject* path, PyObject* obj) {
  const Names& n = names();
  PyObject* pd = path_dict;
  // 1. The pass under way goes by position (PackPath.pack); its first save begins the pass's statistics and reads the
  // model's storages, as the Python path's first steps do.
  PyObject* v;
  if ((v = item(pd, n.before_save)) == nullptr || v != Py_None) return nullptr;
  if ((v = item(pd, n.watching)) == nullptr || v != Py_False) return nullptr;
  if (torch::autograd::get_current_graph_task_id() != -1) return nullptr;
  if ((v = item(tracker_dict, n.by_position)) == nullptr || v != Py_True) return nullptr;
  if ((v = item(pd, n.observers)) == nullptr || !PyList_Check(v) || PyList_GET_SIZE(v) != 0) return nullptr;
  if (!THPVariable_Check(obj)) return nullptr;
  if ((v = item(pd, n.fresh)) == nullptr) return nullptr;
  if (v != Py_False) {
    py::object began = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(path, n.begin_pass));
    if (!began) throw py::error_already_set();
  }
  PyObject* ptrs = item(pd, n.ptrs);
  if (ptrs == Py_None) {
    py::object read = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(path, n.model_storages));
    if (!read || PyObject_SetAttr(path, n.ptrs, read.ptr()) < 0) throw py::error_already_set();
    ptrs = item(pd, n.ptrs);
  }
  PyObject* stats = item(pd, n.stats);
  if (ptrs == nullptr || stats == nullptr || !PyFrozenSet_Check(ptrs)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.has_storage()) return nullptr;
  // 2. A parameter (policy.is_weight): its storage the model's, or a leaf, a view or a cast copy that is one.
  py::object ptr = py::reinterpret_steal<py::object>(PyLong_FromLongLong(reinterpret_cast<int64_t>(t.storage().data())));
  const int weight = PySet_Contains(ptrs, ptr.ptr());
  if (weight < 0) throw py::error_already_set();
  const bool strided = t.layout() == at::kStrided;
  if (weight) return strided && !t.is_meta() ? kept_handle(obj, t._version()) : nullptr;
  const auto& fn = t.grad_fn();
  py::object node;
  PyTypeObject* node_type = Py_TYPE(Py_None);
  Kind kind = kOther;
  if (fn) {
    node = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(fn));
    if (!node) throw py::error_already_set();
    node_type = Py_TYPE(node.ptr());
    kind = kind_of(node_type);
    if (kind == kUnjudged) return nullptr;
  }
  if (!fn || kind == kView || kind == kCopy) {  // a weight only so: most saves are other ops' results
    int param = is_parameter(obj, t);
    if (!param && fn) param = weight_copy(fn);
    if (param < 0) return nullptr;
    if (param) return strided && !t.is_meta() ? kept_handle(obj, t._version()) : nullptr;
  }
  // 3. The save at its position (ModuleTracker.at_position, Trace.at).
  PyObject* stack = item(tracker_dict, n.stack);
  if (stack == nullptr || !PyList_Check(stack) || PyList_GET_SIZE(stack) == 0) return nullptr;
  PyObject* position_obj = item(tracker_dict, n.position);
  PyObject* trace = item(tracker_dict, n.trace);
  if (position_obj == nullptr || trace == nullptr) return nullptr;
  py::object saves = attr(trace, n.saves);
  const int64_t position = as_int(position_obj);
  if (!PyList_Check(saves.ptr()) || position >= PyList_GET_SIZE(saves.ptr())) return nullptr;
  PyObject* at = PyList_GET_ITEM(saves.ptr(), position);  // (key, node, dtype, code, instruction)
  if (!PyTuple_Check(at) || PyTuple_GET_SIZE(at) != 5) return nullptr;
  PyObject* key = PyTuple_GET_ITEM(at, 0);
  PyObject* shape = PyTuple_GetItem(key, 3);
  if (shape == nullptr || !PyTuple_Check(shape)) {
    PyErr_Clear();
    return nullptr;
  }
  const auto sizes = t.sizes();
  if (PyTuple_GET_SIZE(shape) != Py_ssize_t(sizes.size())) return nullptr;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (as_int(PyTuple_GET_ITEM(shape, i)) != sizes[i]) return nullptr;
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  if (PyTuple_GET_ITEM(at, 2) != dtype || PyTuple_GET_ITEM(at, 1) != reinterpret_cast<PyObject*>(node_type))
    return nullptr;
  if (!called_at(PyTuple_GET_ITEM(at, 3), PyTuple_GET_ITEM(at, 4))) return nullptr;
  // 4. Replayed with a packer of its own, nothing else in the way (PackPath._by_position).
  PyObject* replays = item(pd, n.replays);
  PyObject* replay = replays == nullptr ? nullptr : PyDict_GetItemWithError(replays, key);
  if (replay == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return nullptr;
  }
  py::object native = attr(replay, n.native);
  if (native.is_none() || attr(replay, n.shared).ptr() != Py_False) return nullptr;
  if (attr(replay, n.node).ptr() != reinterpret_cast<PyObject*>(node_type) || attr(replay, n.dtype).ptr() != dtype)
    return nullptr;
  if (!strided || (v = item(pd, n.measured)) == nullptr || v != Py_None) return nullptr;
  const int checkpointed = PyObject_IsTrue(attr(saving.ptr(), n.inputs).ptr());
  if (checkpointed != 0) {
    if (checkpointed < 0) throw py::error_already_set();
    return nullptr;
  }
  py::object stats_dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(stats, nullptr));
  if (!stats_dict) throw py::error_already_set();
  PyObject* sd = stats_dict.ptr();
  PyObject* live = item(sd, n.live);
  if (live == nullptr) return nullptr;
  PyObject* seen = PyDict_GetItemWithError(live, ptr.ptr());  // (a tensor on it, its ranges, its number)
  if (seen != nullptr) {
    if (!PyTuple_Check(seen) || PyTuple_GET_SIZE(seen) != 3) return nullptr;
    if (PyWeakref_GetObject(PyTuple_GET_ITEM(seen, 0)) != Py_None) return nullptr;  // held by an earlier save
  } else if (PyErr_Occurred()) {
    throw py::error_already_set();
  }
  const auto* packer = native.cast<const Packer*>();
  if (!packer->accepts(t)) return nullptr;  // what Packer::pack refuses
  // The record: a new storage, counted whole (stats.counted_range of a tensor that is no view, or a view of an op's
  // result), numbered next; the record repeated where its number and bytes are the same.
  PyObject* owner = obj;
  py::object base;
  if (t.is_view()) {
    const at::TensorBase& b = t._base();
    if (!b.grad_fn() && !b.requires_grad()) return nullptr;  // a view of data that lives anyway: its own range
    base = py::reinterpret_steal<py::object>(THPVariable_Wrap(b));
    owner = base.ptr();
  }
  const int64_t covered = int64_t(t.storage().nbytes());
  PyObject* storages_obj = item(sd, n.storages);
  if (storages_obj == nullptr) return nullptr;
  const int64_t number = as_int(storages_obj) + 1;
  py::object like = attr(replay, n.record);
  if (as_int(attr(like.ptr(), n.storage).ptr()) != number || as_int(attr(like.ptr(), n.storage_bytes).ptr()) != covered)
    return nullptr;
  const int64_t packed = as_int(attr(like.ptr(), n.packed_bytes).ptr());
  const bool claims = PyObject_IsTrue(attr(replay, n.claims).ptr()) == 1;
  PyObject* claimed = claims ? item(pd, n.claimed) : nullptr;
  if (claims && (claimed == nullptr || !PySet_Check(claimed))) return nullptr;
  PyObject* records = item(sd, n.records);
  PyObject* kept_ranges = item(sd, n.kept_ranges);
  PyObject* plan = item(pd, n.plan);
  if (records == nullptr || !PyList_Check(records) || kept_ranges == nullptr || !PyDict_Check(kept_ranges) ||
      plan == nullptr)
    return nullptr;
  const uint64_t seed_base = PyLong_AsUnsignedLongLongMask(attr(plan, n.seed_base).ptr());
  const uint64_t weyl = PyLong_AsUnsignedLongLongMask(attr(replay, n.weyl).ptr());
  if (PyErr_Occurred()) throw py::error_already_set();
  // 5. Taken: stored, recorded, claimed, passed.
  const bool timed = timing.load(std::memory_order_relaxed);
  const auto begin = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  std::unique_ptr<Saved> saved = packer->pack(t, int64_t((seed_base + weyl) & kMask62));
  if (timed) {
    timed_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count();
  }
  if (!saved) return nullptr;
  py::object handle = py::cast(std::move(saved));
  py::object ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(owner, nullptr));
  if (!ref) throw py::error_already_set();
  py::list spans;
  if (covered > 0) spans.append(py::make_tuple(0, covered));
  py::object entry = py::make_tuple(ref, spans, number);
  if (PyDict_SetItem(live, ptr.ptr(), entry.ptr()) < 0) throw py::error_already_set();
  if (PyDict_GET_SIZE(kept_ranges) > 0 && PyDict_Contains(kept_ranges, ptr.ptr()) == 1 &&
      PyDict_DelItem(kept_ranges, ptr.ptr()) < 0)
    throw py::error_already_set();
  if (PyList_Append(records, like.ptr()) < 0) throw py::error_already_set();
  add_to(sd, n.storages, 1);
  add_to(sd, n.original_bytes, covered);
  add_to(sd, n.compressed, 1);
  add_to(sd, n.packed_bytes, packed);
  if (claims) {
    py::object id = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLongLong(fn->sequence_nr()));
    if (PySet_Add(claimed, id.ptr()) < 0) throw py::error_already_set();
  }
  py::object next = py::reinterpret_steal<py::object>(PyLong_FromLongLong(position + 1));
  if (PyDict_SetItem(tracker_dict, n.position, next.ptr()) < 0) throw py::error_already_set();
  return handle.release().ptr();
}

PyObject* lane_call(PyObject* self, PyObject* obj) {
  try {
    return static_cast<Lane*>(PyCapsule_GetPointer(self, "gactx.Lane"))->call(obj);
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef lane_def{"lane", lane_call, METH_O, "the pack hook's lane (lane.cpp)"};

}  // namespace

py::object make_lane(py::object path, py::object tracker, py::object kept, py::object saving, py::object view_names,
                     py::object passing, int precall, int precall_to_call) {
  auto* lane = new Lane();
  lane->precall = precall, lane->precall_to_call = precall_to_call;
  lane->path_ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(path.ptr(), nullptr));
  lane->tracker_ref = py::reinterpret_steal<py::object>(PyWeakref_NewRef(tracker.ptr(), nullptr));
  if (!lane->path_ref || !lane->tracker_ref) {
    delete lane;
    throw py::error_already_set();
  }
  lane->kept = kept, lane->saving = saving, lane->view_names = view_names, lane->passing = passing;
  lane->parameter = py::module_::import("torch.nn").attr("Parameter");
  // The instances' own dicts, borrowed: read only while the weak references say that path and tracker live.
  lane->path_dict = PyObject_GenericGetDict(path.ptr(), nullptr);
  lane->tracker_dict = PyObject_GenericGetDict(tracker.ptr(), nullptr);
  if (lane->path_dict == nullptr || lane->tracker_dict == nullptr) {
    delete lane;
    throw py::error_already_set();
  }
  Py_DECREF(lane->path_dict);
  Py_DECREF(lane->tracker_dict);
  py::capsule capsule(lane, "gactx.Lane", [](PyObject* c) {
    delete static_cast<Lane*>(PyCapsule_GetPointer(c, "gactx.Lane"));
  });
  PyObject* fn = PyCFunction_New(&lane_def, capsule.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

int64_t lane_timing(bool on) {
  timing.store(on);
  return timed_ns.exchange(0);
}

}  // namespace gactx
