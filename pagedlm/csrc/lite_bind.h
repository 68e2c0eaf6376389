// Python bindings for the kernels, on Python's C API alone (no pybind11, no torch headers:
// see lite_tensor.h for why). A module is declared as with pybind11:
//
//   PAGEDLM_MODULE(TORCH_EXTENSION_NAME, m) {
//     m.def<&rms_norm>("rms_norm", "RMSNorm ...");
//     m.cls<LlamaDecoder>("LlamaDecoder").init<int64_t, Tensor>().def<&LlamaDecoder::forward>("forward");
//   }
//
// Arguments convert by their C++ type: Tensor from a torch tensor (a view holding a
// reference to it) or from a writable numpy array (any buffer, see buffer_view),
// std::optional<...> from None or the value, int64_t/double/bool, std::vector<...> from a
// list or tuple, a bound class from its Python object. Trailing
// std::optional parameters may be left out. Results: a Tensor returns the torch tensor it
// came from, or a new torch tensor over memory a kernel allocated; vectors become lists and pairs
// tuples. A C++ exception becomes RuntimeError with its message; an argument of the wrong
// kind, TypeError naming its position.
//
// A library may compile several files that include this (their functions bound into one
// module), so its functions and variables are inline: one copy per library. The kernels
// build with hidden visibility (csrc/__init__.py CFLAGS), and Python loads each library
// with local symbols: a process that loads two builds of one library (tests/isa_builds.py)
// keeps two sets of types and torch references, one per build.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lite_tensor.h"

namespace lite_bind {

using pagedlm_lite::ScalarType;
using pagedlm_lite::Tensor;

// An error already set in Python (by a conversion).
struct PythonError {};

// What the conversions look up once: torch's dtypes and Tensor type, and the
// attribute names they read.
struct Torch {
  PyObject* dtypes[pagedlm_lite::kNumScalarTypes] = {};
  PyObject* tensor_type = nullptr;
  PyObject* dtype_kw = nullptr;  // the kwnames tuple ("dtype",) for vectorcall
  PyObject *s_dtype, *s_shape, *s_stride, *s_data_ptr, *s_is_cpu;
};
inline Torch torch_refs;

// A PyObject reference shared by every view of one tensor, released with the GIL held
// (a view may die on any thread).
inline std::shared_ptr<void> hold(PyObject* o) {
  Py_INCREF(o);
  return std::shared_ptr<void>(o, [](void* p) {
    const PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(static_cast<PyObject*>(p));
    PyGILState_Release(state);
  });
}

// Reads a tuple of ints (torch.Size or stride()); false with a Python error set if not.
inline bool int_tuple(PyObject* t, std::vector<int64_t>& out) {
  if (t == nullptr || !PyTuple_Check(t)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

struct Ref {  // owns one new reference
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// DLPack's C structs (dlpack.h, v0.8 ABI, as torch._C._from_dlpack takes them).
struct DLDevice {
  int32_t device_type;  // 1: CPU
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
// torch's DLPack code of each dtype, read at import from a tensor of it (torch names the
// float8 codes by the DLPack version it follows; asking torch keeps them right).
inline DLDataType dl_types[pagedlm_lite::kNumScalarTypes];
inline bool dl_known[pagedlm_lite::kNumScalarTypes];
inline PyObject* from_dlpack = nullptr;

inline PyObject* to_dlpack = nullptr;

// A view of a torch tensor through torch._C._to_dlpack: one call for its pointer, dtype,
// sizes and strides (0.2 us, where reading them as attributes took several). False for
// what DLPack does not export (a tensor that requires grad, a conjugate view): the
// caller reads the attributes instead.
inline bool dlpack_view(PyObject* o, Tensor& out) {
  if (to_dlpack == nullptr) return false;
  Ref capsule(PyObject_CallOneArg(to_dlpack, o));
  if (capsule.p == nullptr) {
    PyErr_Clear();
    return false;
  }
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.p, "dltensor"));
  if (m == nullptr) {
    PyErr_Clear();
    return false;
  }
  const DLTensor& d = m->dl_tensor;
  ScalarType type = ScalarType::Undefined;
  for (int i = 0; i < pagedlm_lite::kNumScalarTypes; ++i) {
    const DLDataType& k = dl_types[i];
    if (dl_known[i] && k.code == d.dtype.code && k.bits == d.dtype.bits && k.lanes == d.dtype.lanes) {
      type = static_cast<ScalarType>(i);
    }
  }
  if (type == ScalarType::Undefined) return false;
  std::vector<int64_t> sizes(d.shape, d.shape + d.ndim);
  std::vector<int64_t> strides = d.strides ? std::vector<int64_t>(d.strides, d.strides + d.ndim)
                                           : pagedlm_lite::contiguous_strides(sizes);
  out = Tensor(static_cast<char*>(d.data) + d.byte_offset, type, std::move(sizes), std::move(strides),
               d.device.device_type == 1, hold(o), o);
  return true;  // the capsule, never consumed, frees its export on release
}

// The dtype of a buffer's struct-module format ("l", "<q", "e", ...) of items of
// `itemsize` bytes; Undefined for a format the kernels do not take (big-endian, compound).
inline ScalarType buffer_type(const char* format, Py_ssize_t itemsize) {
  if (format == nullptr) format = "B";
  if (*format == '@' || *format == '=' || *format == '<') ++format;
  if (format[0] == '\0' || format[1] != '\0') return ScalarType::Undefined;
  ScalarType type = ScalarType::Undefined;
  switch (format[0]) {
    case 'B': type = ScalarType::Byte; break;
    case 'b': type = ScalarType::Char; break;
    case 'h': type = ScalarType::Short; break;
    case 'i': type = ScalarType::Int; break;
    case 'l': case 'q': type = itemsize == 4 ? ScalarType::Int : ScalarType::Long; break;
    case 'e': type = ScalarType::Half; break;
    case 'f': type = ScalarType::Float; break;
    case 'd': type = ScalarType::Double; break;
    case '?': type = ScalarType::Bool; break;
    default: return ScalarType::Undefined;
  }
  return pagedlm_lite::kElementSizes[static_cast<int>(type)] == itemsize ? type : ScalarType::Undefined;
}

// A view of a writable object with Python's buffer protocol (a numpy array), in C alone:
// after a forward pass has pushed torch's Python-facing code out of the caches, each call
// into it (from_numpy, _to_dlpack, .numpy()) costs microseconds, where this costs a few
// hundred nanoseconds. False if `o` has no buffer; a TypeError for one the kernels cannot
// take (read-only, an unknown format, strides not in whole items).
inline bool buffer_view(PyObject* o, Py_ssize_t position, Tensor& out) {
  if (!PyObject_CheckBuffer(o)) return false;
  auto* view = new Py_buffer;
  if (PyObject_GetBuffer(o, view, PyBUF_RECORDS) != 0) {
    delete view;
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "argument %zd: a %s that is not a writable strided buffer",
                 position, Py_TYPE(o)->tp_name);
    throw PythonError{};
  }
  std::shared_ptr<void> owner(view, [](void* p) {
    const PyGILState_STATE state = PyGILState_Ensure();
    PyBuffer_Release(static_cast<Py_buffer*>(p));
    PyGILState_Release(state);
    delete static_cast<Py_buffer*>(p);
  });
  const ScalarType type = buffer_type(view->format, view->itemsize);
  if (type == ScalarType::Undefined) {
    PyErr_Format(PyExc_TypeError, "argument %zd: an array of format '%s' (%zd-byte items), "
                 "which the kernels do not take", position, view->format ? view->format : "B",
                 view->itemsize);
    throw PythonError{};
  }
  std::vector<int64_t> sizes(view->shape, view->shape + view->ndim);
  std::vector<int64_t> strides(view->ndim);
  for (int d = 0; d < view->ndim; ++d) {
    if (view->strides[d] % view->itemsize != 0) {
      PyErr_Format(PyExc_TypeError, "argument %zd: strides not in whole items", position);
      throw PythonError{};
    }
    strides[d] = view->strides[d] / view->itemsize;
  }
  out = Tensor(view->buf, type, std::move(sizes), std::move(strides), true, std::move(owner), o);
  return true;
}

inline Tensor tensor_from(PyObject* o, Py_ssize_t position) {
  const Torch& t = torch_refs;
  if (!PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.tensor_type))) {
    Tensor view;
    if (buffer_view(o, position, view)) return view;
    PyErr_Format(PyExc_TypeError, "argument %zd: expected a torch.Tensor or a numpy array, "
                 "got %s", position, Py_TYPE(o)->tp_name);
    throw PythonError{};
  }
  Tensor view;
  if (dlpack_view(o, view)) return view;
  Ref dtype(PyObject_GetAttr(o, t.s_dtype));
  Ref shape(PyObject_GetAttr(o, t.s_shape));
  Ref strides(PyObject_CallMethodNoArgs(o, t.s_stride));
  Ref data(PyObject_CallMethodNoArgs(o, t.s_data_ptr));
  Ref cpu(PyObject_GetAttr(o, t.s_is_cpu));
  std::vector<int64_t> sizes, steps;
  if (!dtype.p || !cpu.p || !int_tuple(shape.p, sizes) || !int_tuple(strides.p, steps) || !data.p) {
    throw PythonError{};
  }
  ScalarType type = ScalarType::Undefined;
  for (int i = 0; i < pagedlm_lite::kNumScalarTypes; ++i) {
    if (dtype.p == t.dtypes[i]) type = static_cast<ScalarType>(i);
  }
  if (type == ScalarType::Undefined) {
    PyErr_Format(PyExc_TypeError, "argument %zd: a tensor of a dtype the kernels do not take", position);
    throw PythonError{};
  }
  void* ptr = PyLong_AsVoidPtr(data.p);
  if (ptr == nullptr && PyErr_Occurred()) throw PythonError{};
  return Tensor(ptr, type, std::move(sizes), std::move(steps), cpu.p == Py_True, hold(o), o);
}

// New tensors: 64-byte aligned memory of our own (as torch's CPU allocator aligns), handed
// to torch through DLPack when a binding returns one (torch.empty from here cost 1.6 us a
// call, most of a small kernel's call; this, 0.4 us).
inline Tensor allocate(const std::vector<int64_t>& sizes, ScalarType type) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1) *
                                           pagedlm_lite::kElementSizes[static_cast<int>(type)]);
  void* data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (data == nullptr) throw std::bad_alloc();
  return Tensor(data, type, sizes, pagedlm_lite::contiguous_strides(sizes), true, std::shared_ptr<void>(data, std::free), nullptr);
}

struct Exported {
  DLManagedTensor managed;
  std::vector<int64_t> shape, strides;
  std::shared_ptr<void> owner;
};

// A torch tensor over t's memory, keeping it alive.
inline PyObject* to_torch(const Tensor& t) {
  const int type = static_cast<int>(t.scalar_type());
  if (!dl_known[type]) throw std::runtime_error("torch cannot take a tensor of this dtype back");
  auto* e = new Exported{{}, t.sizes(), t.strides(), {}};
  e->owner = t.owner();
  e->managed.dl_tensor = {t.data_ptr(), {1, 0}, static_cast<int32_t>(t.dim()), dl_types[type],
                          e->shape.data(), e->strides.data(), 0};
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); };
  PyObject* capsule = PyCapsule_New(&e->managed, "dltensor", [](PyObject* c) {
    // Never consumed (torch renames a capsule it took): free it here.
    if (PyCapsule_IsValid(c, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
      m->deleter(m);
    }
  });
  if (capsule == nullptr) {
    delete e;
    throw PythonError{};
  }
  PyObject* out = PyObject_CallOneArg(from_dlpack, capsule);
  Py_DECREF(capsule);
  if (out == nullptr) throw PythonError{};
  return out;
}

inline bool init_dlpack(PyObject* torch_module) {
  Ref c(PyObject_GetAttrString(torch_module, "_C"));
  from_dlpack = c.p ? PyObject_GetAttrString(c.p, "_from_dlpack") : nullptr;
  Ref export_(c.p ? PyObject_GetAttrString(c.p, "_to_dlpack") : nullptr);
  Ref empty(PyObject_GetAttrString(torch_module, "empty"));
  if (!from_dlpack || !export_.p || !empty.p) return false;
  for (int i = 0; i < pagedlm_lite::kNumScalarTypes; ++i) {
    Ref zero(PyLong_FromLong(0));
    PyObject* args[2] = {zero.p, torch_refs.dtypes[i]};
    Ref sample(PyObject_Vectorcall(empty.p, args, 1, torch_refs.dtype_kw));
    Ref capsule(sample.p ? PyObject_CallOneArg(export_.p, sample.p) : nullptr);
    if (capsule.p == nullptr) {  // a dtype torch does not export
      PyErr_Clear();
      continue;
    }
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.p, "dltensor"));
    if (m == nullptr) return false;
    dl_types[i] = m->dl_tensor.dtype;
    dl_known[i] = true;
  }
  // Two dtypes under one code could not be told apart: neither goes through DLPack.
  for (int i = 0; i < pagedlm_lite::kNumScalarTypes; ++i) {
    for (int j = 0; j < i; ++j) {
      const DLDataType &a = dl_types[i], &b = dl_types[j];
      if (dl_known[i] && dl_known[j] && a.code == b.code && a.bits == b.bits && a.lanes == b.lanes) {
        dl_known[i] = dl_known[j] = false;
      }
    }
  }
  Py_INCREF(export_.p);
  to_dlpack = export_.p;
  return true;
}

inline void* save_thread() { return PyEval_SaveThread(); }
inline void restore_thread(void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }

inline bool init_torch() {
  Torch& t = torch_refs;
  Ref torch(PyImport_ImportModule("torch"));
  if (!torch.p) return false;
  for (int i = 0; i < pagedlm_lite::kNumScalarTypes; ++i) {
    t.dtypes[i] = PyObject_GetAttrString(torch.p, pagedlm_lite::kScalarTypeNames[i]);
    if (!t.dtypes[i]) return false;
  }
  t.tensor_type = PyObject_GetAttrString(torch.p, "Tensor");
  t.dtype_kw = Py_BuildValue("(s)", "dtype");
  t.s_dtype = PyUnicode_InternFromString("dtype");
  t.s_shape = PyUnicode_InternFromString("shape");
  t.s_stride = PyUnicode_InternFromString("stride");
  t.s_data_ptr = PyUnicode_InternFromString("data_ptr");
  t.s_is_cpu = PyUnicode_InternFromString("is_cpu");
  pagedlm_lite::allocate = &allocate;
  pagedlm_lite::save_thread = &save_thread;
  pagedlm_lite::restore_thread = &restore_thread;
  return t.tensor_type && t.dtype_kw && init_dlpack(torch.p);
}

// ---- bound classes: a Python object holding a heap-allocated T ----

template <typename T>
struct Instance {
  PyObject_HEAD
  T* value;
};

template <typename T>
PyTypeObject* class_type = nullptr;

template <typename T>
PyObject* wrap_instance(T value) {
  PyTypeObject* type = class_type<T>;
  PyObject* o = type->tp_alloc(type, 0);
  if (o == nullptr) throw PythonError{};
  reinterpret_cast<Instance<T>*>(o)->value = new T(std::move(value));
  return o;
}

template <typename T>
T& instance_of(PyObject* o, Py_ssize_t position) {
  PyTypeObject* type = class_type<T>;
  if (type == nullptr || !PyObject_TypeCheck(o, type) || !reinterpret_cast<Instance<T>*>(o)->value) {
    PyErr_Format(PyExc_TypeError, "argument %zd: expected %s, got %s", position,
                 type ? type->tp_name : "a bound object", Py_TYPE(o)->tp_name);
    throw PythonError{};
  }
  return *reinterpret_cast<Instance<T>*>(o)->value;
}

// ---- argument conversions ----

template <typename T, typename = void>
struct Arg {  // a bound class
  static T get(PyObject* o, Py_ssize_t position) { return instance_of<T>(o, position); }
};
template <>
struct Arg<Tensor> {
  static Tensor get(PyObject* o, Py_ssize_t position) { return tensor_from(o, position); }
};
template <typename T>
struct Arg<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static T get(PyObject* o, Py_ssize_t position) {
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "argument %zd: expected an int, got %s", position, Py_TYPE(o)->tp_name);
      throw PythonError{};
    }
    return static_cast<T>(v);
  }
};
template <typename T>
struct Arg<T, std::enable_if_t<std::is_floating_point_v<T>>> {
  static T get(PyObject* o, Py_ssize_t position) {
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "argument %zd: expected a float, got %s", position, Py_TYPE(o)->tp_name);
      throw PythonError{};
    }
    return static_cast<T>(v);
  }
};
template <>
struct Arg<bool> {
  static bool get(PyObject* o, Py_ssize_t position) {
    const int v = PyObject_IsTrue(o);
    if (v < 0) throw PythonError{};
    return v == 1;
  }
};
template <typename T>
struct Arg<std::optional<T>> {
  static std::optional<T> get(PyObject* o, Py_ssize_t position) {
    if (o == Py_None) return std::nullopt;
    return Arg<T>::get(o, position);
  }
};
template <typename T>
struct Arg<std::vector<T>> {
  static std::vector<T> get(PyObject* o, Py_ssize_t position) {
    if (!PyList_Check(o) && !PyTuple_Check(o)) {
      PyErr_Format(PyExc_TypeError, "argument %zd: expected a list, got %s", position, Py_TYPE(o)->tp_name);
      throw PythonError{};
    }
    Ref seq(PySequence_Fast(o, ""));
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.p);
    PyObject** items = PySequence_Fast_ITEMS(seq.p);
    std::vector<T> out;
    out.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) out.push_back(Arg<T>::get(items[i], position));
    return out;
  }
};

template <typename T>
using Bare = std::remove_cv_t<std::remove_reference_t<T>>;

// ---- results ----

// A tensor that came from Python as itself; one the kernel allocated, as a new torch
// tensor over its memory.
inline PyObject* result(const Tensor& t) {
  PyObject* o = static_cast<PyObject*>(t.source());
  if (o == nullptr) return to_torch(t);
  Py_INCREF(o);
  return o;
}
inline PyObject* result(int64_t v) { return PyLong_FromLongLong(v); }
inline PyObject* result(int v) { return PyLong_FromLong(v); }
inline PyObject* result(double v) { return PyFloat_FromDouble(v); }
inline PyObject* result(bool v) { return PyBool_FromLong(v); }
inline PyObject* result(const std::string& v) { return PyUnicode_FromStringAndSize(v.data(), v.size()); }
template <typename T>
PyObject* result(const T& v);
template <typename A, typename B>
PyObject* result(const std::pair<A, B>& v) {
  Ref a(result(v.first));
  Ref b(a.p ? result(v.second) : nullptr);
  return b.p ? PyTuple_Pack(2, a.p, b.p) : nullptr;
}
template <typename T>
PyObject* result(const std::vector<T>& v) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
  for (size_t i = 0; list && i < v.size(); ++i) {
    PyObject* item = result(v[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}
template <typename T>
PyObject* result(const T& v) {  // a bound class, by value
  return wrap_instance<T>(v);
}

// ---- calls ----

template <typename T>
struct is_optional : std::false_type {};
template <typename T>
struct is_optional<std::optional<T>> : std::true_type {};
template <typename... Params>
constexpr Py_ssize_t required_count() {
  constexpr bool optional[] = {false, is_optional<Bare<Params>>::value...};
  Py_ssize_t required = static_cast<Py_ssize_t>(sizeof...(Params));
  while (required > 0 && optional[required]) --required;
  return required;
}

template <typename P>
Bare<P> convert(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t i) {
  if (i >= nargs) return Bare<P>{};  // a left-out optional: nullopt
  return Arg<Bare<P>>::get(args[i], i + 1);
}

inline bool check_count(const char* name, Py_ssize_t nargs, Py_ssize_t required, Py_ssize_t total) {
  if (nargs >= required && nargs <= total) return true;
  PyErr_Format(PyExc_TypeError, "%s() takes %zd%s arguments, got %zd", name, total,
               required < total ? " (trailing ones optional)" : "", nargs);
  return false;
}

template <typename F>
PyObject* guarded(F&& body) {
  try {
    return body();
  } catch (const PythonError&) {
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

template <typename R, typename Call>
PyObject* call_and_convert(Call&& call) {
  if constexpr (std::is_void_v<R>) {
    call();
    Py_RETURN_NONE;
  } else {
    return result(call());
  }
}

template <auto F>
struct Function;
template <typename R, typename... Params, R (*F)(Params...)>
struct Function<F> {
  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    return guarded([&]() -> PyObject* {
      if (!check_count("kernel", nargs, required_count<Params...>(), sizeof...(Params))) return nullptr;
      return invoke(args, nargs, std::index_sequence_for<Params...>{});
    });
  }
  template <size_t... I>
  static PyObject* invoke(PyObject* const* args, Py_ssize_t nargs, std::index_sequence<I...>) {
    std::tuple<Bare<Params>...> values{convert<Params>(args, nargs, I)...};
    return call_and_convert<R>([&]() -> decltype(auto) { return F(std::get<I>(values)...); });
  }
};

// A member function M of C (const or not) called on the object `self` holds.
template <auto M, typename C, typename R, typename... Params>
struct BoundMethod {
  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    return guarded([&]() -> PyObject* {
      if (!check_count("method", nargs, required_count<Params...>(), sizeof...(Params))) return nullptr;
      return invoke(instance_of<C>(self, 0), args, nargs, std::index_sequence_for<Params...>{});
    });
  }
  template <size_t... I>
  static PyObject* invoke(C& obj, PyObject* const* args, Py_ssize_t nargs, std::index_sequence<I...>) {
    std::tuple<Bare<Params>...> values{convert<Params>(args, nargs, I)...};
    return call_and_convert<R>([&]() -> decltype(auto) { return (obj.*M)(std::get<I>(values)...); });
  }
};
template <auto M>
struct Method;
template <typename C, typename R, typename... Params, R (C::*M)(Params...)>
struct Method<M> : BoundMethod<M, C, R, Params...> {};
template <typename C, typename R, typename... Params, R (C::*M)(Params...) const>
struct Method<M> : BoundMethod<M, C, R, Params...> {};

// Constructors: T(Params...) from a call's positional arguments.
template <typename T, typename... Params>
struct Init {
  static PyObject* make(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    return guarded([&]() -> PyObject* {
      if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "keyword arguments are not taken");
        return nullptr;
      }
      const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
      if (!check_count(type->tp_name, nargs, sizeof...(Params), sizeof...(Params))) return nullptr;
      return build(type, &PyTuple_GET_ITEM(args, 0), nargs, std::index_sequence_for<Params...>{});
    });
  }
  template <size_t... I>
  static PyObject* build(PyTypeObject* type, PyObject* const* args, Py_ssize_t nargs, std::index_sequence<I...>) {
    std::tuple<Bare<Params>...> values{convert<Params>(args, nargs, I)...};
    T* value = new T(std::get<I>(values)...);
    PyObject* o = type->tp_alloc(type, 0);
    if (o == nullptr) {
      delete value;
      return nullptr;
    }
    reinterpret_cast<Instance<T>*>(o)->value = value;
    return o;
  }
};

// ---- module and classes ----

template <typename T>
class Class {
 public:
  Class(const char* module_name, const char* name)
      : name_(std::string(module_name) + "." + name), short_name_(name) {}
  template <typename... Params>
  Class& init() {
    new_ = &Init<T, Params...>::make;
    return *this;
  }
  template <auto M>
  Class& def(const char* name, const char* doc = nullptr) {
    methods_->push_back({name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Method<M>::call)),
                         METH_FASTCALL, doc});
    return *this;
  }
  template <auto F>
  Class& def_static(const char* name, const char* doc = nullptr) {
    methods_->push_back({name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Function<F>::call)),
                         METH_FASTCALL | METH_STATIC, doc});
    return *this;
  }
  // Makes the type (after every def) and adds it to `module`.
  bool finish(PyObject* module) {
    methods_->push_back({nullptr, nullptr, 0, nullptr});
    static std::vector<PyType_Slot> slots;
    slots = {{Py_tp_dealloc, reinterpret_cast<void*>(&dealloc)},
             {Py_tp_methods, methods_->data()}};
    if (new_ != nullptr) slots.push_back({Py_tp_new, reinterpret_cast<void*>(new_)});
    slots.push_back({0, nullptr});
    static std::string name;
    name = name_;
    static PyType_Spec spec;
    spec = {name.c_str(), sizeof(Instance<T>), 0, Py_TPFLAGS_DEFAULT, slots.data()};
    PyObject* type = PyType_FromSpec(&spec);
    if (type == nullptr) return false;
    class_type<T> = reinterpret_cast<PyTypeObject*>(type);
    return PyModule_AddObject(module, short_name_, type) == 0;
  }

 private:
  static void dealloc(PyObject* o) {
    delete reinterpret_cast<Instance<T>*>(o)->value;
    PyTypeObject* type = Py_TYPE(o);
    type->tp_free(o);
    Py_DECREF(type);
  }

  std::string name_;
  const char* short_name_;
  newfunc new_ = nullptr;
  // Lives as long as the type (the process): one list per bound class.
  std::vector<PyMethodDef>* methods_ = new std::vector<PyMethodDef>();
};

class Module {
 public:
  Module(const char* name) : name_(name) {}
  template <auto F>
  Module& def(const char* name, const char* doc = nullptr) {
    functions_.push_back({name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Function<F>::call)),
                          METH_FASTCALL, doc});
    return *this;
  }
  void attr(const char* name, int64_t value) { ints_.emplace_back(name, value); }
  template <typename T>
  Class<T>& cls(const char* name) {
    auto* c = new Class<T>(name_, name);  // lives as long as its type: the process
    classes_.push_back([c](PyObject* module) { return c->finish(module); });
    return *c;
  }

  PyObject* create() {
    if (!init_torch()) return nullptr;
    functions_.push_back({nullptr, nullptr, 0, nullptr});
    static PyModuleDef def;
    def = {PyModuleDef_HEAD_INIT, name_, nullptr, -1, functions_.data(), nullptr, nullptr, nullptr, nullptr};
    PyObject* module = PyModule_Create(&def);
    if (module == nullptr) return nullptr;
    for (auto& [name, value] : ints_) {
      if (PyModule_AddIntConstant(module, name, value) != 0) return nullptr;
    }
    for (auto& finish : classes_) {
      if (!finish(module)) {
        Py_DECREF(module);
        return nullptr;
      }
    }
    return module;
  }

 private:
  const char* name_;
  std::vector<PyMethodDef> functions_;
  std::vector<std::pair<const char*, int64_t>> ints_;
  std::vector<std::function<bool(PyObject*)>> classes_;
};

}  // namespace lite_bind

// PyInit_<name>: the module `name` with what the body binds into m (a lite_bind::Module).
#define PAGEDLM_LITE_CAT(a, b) a##b
#define PAGEDLM_LITE_STR(a) #a
#define PAGEDLM_MODULE(name, m) PAGEDLM_MODULE_(name, PAGEDLM_LITE_STR(name), m)
#define PAGEDLM_MODULE_(name, quoted, m)                          \
  static void pagedlm_bind(lite_bind::Module& m);                 \
  PyMODINIT_FUNC PAGEDLM_LITE_CAT(PyInit_, name)() {              \
    static lite_bind::Module module(quoted);                      \
    pagedlm_bind(module);                                         \
    return module.create();                                       \
  }                                                               \
  static void pagedlm_bind(lite_bind::Module& m)
