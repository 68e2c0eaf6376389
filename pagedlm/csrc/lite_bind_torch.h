// Tensors across the Python boundary, for lite_bind.h (which includes this): views of torch
// tensors (through DLPack) and of writable numpy buffers, new tensors handed back to torch
// over a kernel's own memory, and the torch references the conversions look up once.
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

}  // namespace lite_bind
