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
//
// Tensors' conversions (DLPack views, numpy buffers, new tensors): lite_bind_torch.h.
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

#include "lite_bind_torch.h"

namespace lite_bind {

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
