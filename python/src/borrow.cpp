// SPDX-License-Identifier: Apache-2.0
// Python tensors in, as borrowed DLTensors; streams; errors out.
//
// The step path calls capture once per MoE layer, so describing a tensor must
// cost well under a microsecond. In order of preference:
//  1. the producer's DLPack C exchange API (`type(x).__dlpack_c_exchange_api__`,
//     PyTorch >= 2.10): a C call fills the DLTensor, no Python, no sync;
//  2. PyTorch without it: data_ptr(), shape, stride(), dtype read directly
//     (its __dlpack__ costs ~20 us and synchronizes streams, illegal while a
//     CUDA graph is captured);
//  3. the buffer protocol (NumPy and anything like it), read-only when allowed;
//  4. nanobind's ndarray import: any other __dlpack__ producer (JAX, CuPy, ...).
#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include "binding.h"

#ifdef __GLIBCXX__
#include <cxxabi.h>  // abi::__forced_unwind
#endif
#include "plugin/tensor_args.h"

namespace moecap_python {
namespace {

// DLPack 1.x's exchange API table (dlpack.h >= 1.2), declared here because
// the dlpack.h this project builds against predates it. Layout per the spec.
struct ExchangeApi {
  DLPackVersion version;
  void* prev_api;
  void* managed_tensor_allocator;
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorVersioned** out);
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(DLDeviceType device_type, int32_t device_id, void** out_stream);
};

// Types seen, with their exchange API or nullptr. Each entry holds a weak
// reference to its type: a class freed and another made at its address must
// not inherit the entry, and a strong one would keep the class's module (and
// everything it holds) alive until exit.
struct TypeCache {
  static constexpr int kSize = 16;
  PyTypeObject* type[kSize]{};
  PyObject* alive[kSize]{};  // a weakref to type[i]; dead once the type is freed
  const ExchangeApi* api[kSize]{};
  int used = 0;
};
TypeCache type_cache;

// Whether entry i's type still lives (its weakref still leads to it).
bool type_alive(int i) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  if (PyWeakref_GetRef(type_cache.alive[i], &target) < 0) PyErr_Clear();
  const bool alive = target == reinterpret_cast<PyObject*>(type_cache.type[i]);
  Py_XDECREF(target);
  return alive;
#else
  return PyWeakref_GetObject(type_cache.alive[i]) == reinterpret_cast<PyObject*>(type_cache.type[i]);
#endif
}

const ExchangeApi* exchange_api(PyTypeObject* type) {
  for (int i = 0; i < type_cache.used; ++i) {
    if (type_cache.type[i] == type && type_alive(i)) return type_cache.api[i];
  }
  int stale = -1;
  for (int i = 0; i < type_cache.used && stale < 0; ++i) {
    if (!type_alive(i)) stale = i;
  }
  const ExchangeApi* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    auto* table = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
    if (table == nullptr) PyErr_Clear();
    if (table != nullptr && table->version.major == 1 && table->dltensor_from_py_object_no_sync != nullptr) api = table;
    Py_DECREF(capsule);  // the table lives as long as the process (per the spec)
  }
  const int slot = stale >= 0 ? stale : (type_cache.used < TypeCache::kSize ? type_cache.used : -1);
  if (slot < 0) return api;
  PyObject* ref = PyWeakref_NewRef(reinterpret_cast<PyObject*>(type), nullptr);
  if (ref == nullptr) {
    PyErr_Clear();  // not cached: asked again next time
    return api;
  }
  Py_XDECREF(type_cache.alive[slot]);
  type_cache.type[slot] = type;
  type_cache.alive[slot] = ref;
  type_cache.api[slot] = api;
  if (slot == type_cache.used) ++type_cache.used;
  return api;
}

// What we know about PyTorch once it is imported (moecap never imports it).
// Plain pointers, never released: a static nb::object would be destroyed
// after the interpreter finalized.
struct TorchTypes {
  bool known = false;
  PyTypeObject* tensor = nullptr;
  const ExchangeApi* api = nullptr;  // torch.Tensor's, when it has one
  struct Dtype {
    PyObject* object;
    DLDataType dl;
  };
  Dtype dtypes[12]{};
  int num_dtypes = 0;
  PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream(device) -> int
};
TorchTypes torch_types;

bool torch_ready() {
  if (torch_types.known) return true;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed; no import
  if (torch == nullptr) return false;
  nb::handle t(torch);
  if (!nb::hasattr(t, "Tensor") || !nb::hasattr(t, "bfloat16") || !nb::hasattr(t, "_C")) return false;  // mid-import
  torch_types.tensor = reinterpret_cast<PyTypeObject*>(t.attr("Tensor").ptr());
  torch_types.api = exchange_api(torch_types.tensor);
  struct {
    const char* name;
    uint8_t code, bits;
  } table[] = {{"int8", kDLInt, 8},       {"int16", kDLInt, 16},       {"int32", kDLInt, 32},
               {"int64", kDLInt, 64},     {"uint8", kDLUInt, 8},       {"uint16", kDLUInt, 16},
               {"uint32", kDLUInt, 32},   {"float16", kDLFloat, 16},   {"float32", kDLFloat, 32},
               {"float64", kDLFloat, 64}, {"bfloat16", kDLBfloat, 16}, {"bool", 6 /* kDLBool, DLPack >= 0.8 */, 8}};
  for (const auto& d : table) {
    if (!nb::hasattr(t, d.name)) continue;
    torch_types.dtypes[torch_types.num_dtypes++] = {t.attr(d.name).ptr(), DLDataType{d.code, d.bits, 1}};
  }
  nb::object c = t.attr("_C");
  if (nb::hasattr(c, "_cuda_getCurrentRawStream")) {
    torch_types.raw_stream = nb::object(c.attr("_cuda_getCurrentRawStream")).release().ptr();
  }
  torch_types.known = true;  // torch is never unloaded: the type and dtype objects stay valid
  return true;
}

// Test hook (_moecap._fast_paths): which of paths 1 and 2 are tried.
bool use_exchange_api = true;
bool use_torch_attributes = true;

// "Type: message" of a caught Python exception, without nanobind's traceback.
std::string exception_text(nb::python_error& e) {
  const std::string type = nb::cast<std::string>(nb::handle(e.type()).attr("__name__"));
  return type + ": " + nb::cast<std::string>(nb::str(e.value()));
}

// The TypeError of every refused tensor argument: "moecap: argument 'name' <what>".
[[noreturn]] void argument_error(const char* name, const std::string& what) {
  throw nb::type_error(("moecap: argument '" + std::string(name) + "' " + what).c_str());
}

std::string type_of(nb::handle obj) {
  return nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())))));
}

[[noreturn]] void type_error(const char* name, nb::handle obj, const char* why) {
  argument_error(name, std::string(why) + ", not " + type_of(obj));
}

void copy_dims(const int64_t* shape, const int64_t* strides, Borrowed& out, const char* name, nb::handle obj) {
  if (out.dl.ndim < 0 || out.dl.ndim > Borrowed::kMaxDims) type_error(name, obj, "has more than 8 dimensions");
  int64_t compact = 1;
  for (int i = out.dl.ndim - 1; i >= 0; --i) {
    out.shape[i] = shape[i];
    out.strides[i] = strides != nullptr ? strides[i] : compact;
    compact *= shape[i];
  }
  out.dl.shape = out.shape;
  out.dl.strides = out.strides;
}

// A tensor moecap writes into, refused where its producer exports it
// read-only (torch.utils.dlpack.ReadOnlyTensorWrapper's exchange API, a
// table of its own). The DLTensor of the fast call carries no flags, so the
// managed export is asked for them, and released at once: the DLTensor still
// comes from the fast call.
void refuse_read_only_export(const ExchangeApi* api, nb::handle obj, const char* name) {
  if (api->managed_tensor_from_py_object_no_sync == nullptr) return;
  DLManagedTensorVersioned* managed = nullptr;
  if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &managed) != 0 || managed == nullptr) {
    PyErr_Clear();
    return;  // the fast call, or a slower path, decides
  }
  const bool read_only = (managed->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  if (managed->deleter != nullptr) managed->deleter(managed);
  if (read_only) {
    argument_error(name, "is a " + type_of(obj) + " exported read-only (DLPack's READ_ONLY flag); moecap writes into it");
  }
}

bool borrow_exchange(const ExchangeApi* api, nb::handle obj, const char* name, Borrowed& out) {
  DLTensor t{};
  if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
    PyErr_Clear();
    return false;  // let a slower path try, or name the argument in its error
  }
  out.dl = t;
  copy_dims(t.shape, t.strides, out, name, obj);
  return true;
}

int copy_tuple(PyObject* tuple, int64_t* out, const char* name, nb::handle obj) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  if (n > Borrowed::kMaxDims) type_error(name, obj, "has more than 8 dimensions");
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
  return static_cast<int>(n);
}

// A torch attribute or method's result: torch's refusal (RuntimeError:
// sparse and nested tensors have no strides, fake tensors no data,
// torch.utils.dlpack.ReadOnlyTensorWrapper allows nothing but DLPack)
// becomes ours, naming the argument and what moecap would do with it
// (`use`); anything else (KeyboardInterrupt, a subclass's own error) goes on.
nb::object torch_attribute(PyObject* got, const char* name, const char* use) {
  if (got == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError) && !PyErr_ExceptionMatches(PyExc_NotImplementedError)) {
      throw nb::python_error();
    }
    nb::python_error refused;
    argument_error(name, std::string("is a torch tensor moecap cannot ") + use + " in place: " + exception_text(refused));
  }
  return nb::steal(got);
}

void borrow_torch_attributes(nb::handle obj, const char* name, Borrowed& out) {
  static PyObject *data_ptr = PyUnicode_InternFromString("data_ptr"), *shape = PyUnicode_InternFromString("shape"),
                  *stride = PyUnicode_InternFromString("stride"), *dtype = PyUnicode_InternFromString("dtype"),
                  *is_cuda = PyUnicode_InternFromString("is_cuda"), *is_cpu = PyUnicode_InternFromString("is_cpu"),
                  *get_device = PyUnicode_InternFromString("get_device");
  // Each result is checked before the next call: a sparse or nested tensor
  // raises at stride() or data_ptr(), and a call made with that exception
  // pending would report some other failure.
  const auto attribute = [&](PyObject* got) { return torch_attribute(got, name, "borrow"); };
  nb::object dt = attribute(PyObject_GetAttr(obj.ptr(), dtype));
  const TorchTypes::Dtype* found = nullptr;
  for (int i = 0; i < torch_types.num_dtypes; ++i) {
    if (torch_types.dtypes[i].object == dt.ptr()) found = &torch_types.dtypes[i];
  }
  if (found == nullptr) type_error(name, obj, "has a dtype DLPack cannot describe");
  out.dl.dtype = found->dl;
  nb::object sizes = attribute(PyObject_GetAttr(obj.ptr(), shape));
  nb::object steps = attribute(PyObject_CallMethodNoArgs(obj.ptr(), stride));
  nb::object address = attribute(PyObject_CallMethodNoArgs(obj.ptr(), data_ptr));
  nb::object cuda = attribute(PyObject_GetAttr(obj.ptr(), is_cuda));
  out.dl.ndim = copy_tuple(sizes.ptr(), out.shape, name, obj);
  copy_tuple(steps.ptr(), out.strides, name, obj);
  out.dl.shape = out.shape;
  out.dl.strides = out.strides;
  out.dl.data = reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(address.ptr())));
  out.dl.device = DLDevice{kDLCPU, 0};
  if (cuda.ptr() != Py_True) {
    // Memory on another device (meta, MPS, XPU, ...) must not pass for host memory.
    nb::object cpu = nb::steal(PyObject_GetAttr(obj.ptr(), is_cpu));
    if (!cpu.is_valid()) throw nb::python_error();
    if (cpu.ptr() != Py_True) type_error(name, obj, "is on a device moecap does not take (CPU and CUDA tensors only)");
  } else {
    nb::object index = nb::steal(PyObject_CallMethodNoArgs(obj.ptr(), get_device));
    if (!index.is_valid()) throw nb::python_error();
    out.dl.device = DLDevice{kDLCUDA, static_cast<int32_t>(PyLong_AsLong(index.ptr()))};
  }
}

// struct-module format characters of the buffer protocol, native byte order.
bool dtype_of_format(const char* format, Py_ssize_t itemsize, DLDataType& out) {
  if (format == nullptr) format = "B";
  if (*format == '@' || *format == '=' || *format == '<') ++format;  // little-endian host
  if (format[0] == '\0' || format[1] != '\0') return false;
  const uint8_t bits = static_cast<uint8_t>(itemsize * 8);
  switch (format[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': out = DLDataType{kDLInt, bits, 1}; return true;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': out = DLDataType{kDLUInt, bits, 1}; return true;
    case 'e': case 'f': case 'd': out = DLDataType{kDLFloat, bits, 1}; return true;
    case '?': out = DLDataType{6 /* kDLBool */, 8, 1}; return true;
    default: return false;
  }
}

bool borrow_buffer(nb::handle obj, const char* name, bool writable, Borrowed& out) {
  if (PyObject_GetBuffer(obj.ptr(), &out.buffer, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  out.has_buffer = true;
  const Py_buffer& b = out.buffer;
  if (!dtype_of_format(b.format, b.itemsize, out.dl.dtype) || b.ndim > Borrowed::kMaxDims ||
      (b.ndim > 0 && b.shape == nullptr)) {
    out.release_buffer();
    return false;
  }
  out.dl.data = b.buf;
  out.dl.device = DLDevice{kDLCPU, 0};
  out.dl.ndim = b.ndim;
  // NULL strides mean C order (ctypes arrays export them so).
  Py_ssize_t compact = b.itemsize;
  for (int i = b.ndim - 1; i >= 0; --i) {
    const Py_ssize_t stride = b.strides != nullptr ? b.strides[i] : compact;
    compact *= b.shape[i];
    if (stride % b.itemsize != 0) {  // not expressible in elements: let nanobind refuse it
      out.release_buffer();
      return false;
    }
    out.shape[i] = b.shape[i];
    out.strides[i] = stride / b.itemsize;
  }
  out.dl.shape = out.shape;
  out.dl.strides = out.strides;
  (void)name;
  return true;
}

template <class Array>
void borrow_ndarray(const Array& a, Borrowed& out, const char* name, nb::handle obj) {
  // nanobind folds byte_offset into data(), wrapping past the address
  // space's end unchecked; such a capsule describes no memory at all.
  uintptr_t first = 0;
  if (__builtin_add_overflow(reinterpret_cast<uintptr_t>(a.data_handle()), a.byte_offset(), &first)) {
    raise_error(MOECAP_ERROR_INVALID_ARGUMENT, std::string(name) + "'s DLPack byte_offset is " +
                                                   std::to_string(a.byte_offset()) +
                                                   "; data + byte_offset wraps around the address space");
  }
  out.dl.data = reinterpret_cast<void*>(first);
  out.dl.ndim = static_cast<int32_t>(a.ndim());
  auto dt = a.dtype();
  out.dl.dtype = DLDataType{dt.code, dt.bits, dt.lanes};
  // Never converted to DLDeviceType: DLPack 1.0 types past the end of the enum
  // we compile against would make that conversion undefined.
  moecap::set_device_kind(out.dl.device, static_cast<int32_t>(a.device_type()));
  out.dl.device.device_id = static_cast<int32_t>(a.device_id());
  copy_dims(a.shape_ptr(), a.stride_ptr(), out, name, obj);
}

}  // namespace

GilRelease::~GilRelease() {
  if (in_flight_ != nullptr) --*in_flight_;
#ifdef __GLIBCXX__
  // Python (<= 3.13) ends a thread other than the finalizing one that takes
  // the GIL back during finalization with pthread_exit; its unwinding is
  // caught here, before it reaches this noexcept destructor, and never
  // completed: the thread waits for the process to exit. (The finalizing
  // thread itself, running a __del__ that calls moecap, takes the GIL back.)
  try {
    PyEval_RestoreThread(state_);
  } catch (abi::__forced_unwind&) {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
#else
  PyEval_RestoreThread(state_);
#endif
}

void Borrowed::release_buffer() {
  if (has_buffer) PyBuffer_Release(&buffer);
  has_buffer = false;
}

void raise_error(moecap_status status, const std::string& message) {
  nb::object cls = nb::module_::import_("moecap._errors").attr("MoecapError");
  nb::object error = cls(static_cast<int>(status), message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw nb::python_error();
}

void check(moecap_status status) { check(status, {}); }

void check(moecap_status status, std::initializer_list<Rename> renames) {
  if (status == MOECAP_OK) return;
  std::string message = moecap_last_error();
  const auto replace = [&message](const std::string& from, const std::string& to) {
    for (size_t at = message.find(from); at != std::string::npos; at = message.find(from, at + to.size())) {
      message.replace(at, from.size(), to);
    }
  };
  for (const Rename& r : renames) replace(r.c_name, r.python_name);
  replace("->", ".");  // the C message's ids->shape[1] is ids.shape[1] to a Python caller
  replace("moecap_get_errors with MOECAP_ERRORS_CLEAR", "errors(clear=True)");  // ROWS_SKIPPED's remedy
  raise_error(status, message);
}

int32_t as_int32(int64_t value, const char* function, const char* name) {
  if (value < INT32_MIN || value > INT32_MAX) {
    raise_error(MOECAP_ERROR_OUT_OF_RANGE, std::string(function) + ": " + name + " is " + std::to_string(value) +
                                               "; it must fit in int32 [-2147483648, 2147483647]");
  }
  return static_cast<int32_t>(value);
}

namespace {

// int_argument for a C type of `bits` (32 or 64) bits: a value past it is
// OUT_OF_RANGE with that type's range (as_int32's words for int32).
int64_t integer_of_width(nb::handle value, const char* function, const char* name, int bits) {
  auto refuse = [&](const char* type_name) -> int64_t {
    throw nb::type_error((std::string(function) + ": " + name + " must be an int, not " + type_name).c_str());
  };
  nb::object index;
  if (PyLong_CheckExact(value.ptr())) {
    index = nb::borrow(value);
  } else {
    // True is an int to Python, and a 0-d torch bool has __index__; neither
    // is a layer, a row or a count (NumPy's bool has no __index__).
    if (PyBool_Check(value.ptr())) return refuse("bool");
    if (nb::hasattr(value, "dtype")) {
      const nb::object dtype = value.attr("dtype");
      const nb::object text = nb::steal(PyObject_Str(dtype.ptr()));
      if (!text.is_valid()) throw nb::python_error();
      const char* name_of_dtype = PyUnicode_AsUTF8(text.ptr());
      if (name_of_dtype == nullptr) throw nb::python_error();
      if (std::string_view(name_of_dtype) == "torch.bool") return refuse("a bool tensor");
    }
    index = nb::steal(PyNumber_Index(value.ptr()));
    if (!index.is_valid()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();  // KeyboardInterrupt and the like
      PyErr_Clear();
      return refuse(Py_TYPE(value.ptr())->tp_name);
    }
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow == 0) return bits == 64 ? v : as_int32(v, function, name);
  raise_error(MOECAP_ERROR_OUT_OF_RANGE,
              std::string(function) + ": " + name + " is " + nb::cast<std::string>(nb::str(index)) +
                  (bits == 64 ? "; it must fit in int64 [-9223372036854775808, 9223372036854775807]"
                              : "; it must fit in int32 [-2147483648, 2147483647]"));
}

}  // namespace

int64_t int_argument(nb::handle value, const char* function, const char* name) {
  return integer_of_width(value, function, name, 64);
}

int32_t int32_argument(nb::handle value, const char* function, const char* name) {
  return static_cast<int32_t>(integer_of_width(value, function, name, 32));
}

std::vector<int64_t> int_list(nb::handle value, const char* function, const char* name) {
  // A sequence (an array or a tensor too): a set or a dict has no order, a generator no length to trust.
  const bool text = PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr());
  const bool ordered = PySequence_Check(value.ptr()) || nb::hasattr(value, "__dlpack__");
  nb::object iterator;
  if (ordered && !text) {
    iterator = nb::steal(PyObject_GetIter(value.ptr()));
    if (!iterator.is_valid()) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
      PyErr_Clear();
    }
  }
  if (!iterator.is_valid()) {
    throw nb::type_error((std::string(function) + ": " + name + " must be a sequence of ints, not " +
                          Py_TYPE(value.ptr())->tp_name)
                             .c_str());
  }
  std::vector<int64_t> values;
  while (PyObject* item = PyIter_Next(iterator.ptr())) {
    const nb::object owned = nb::steal(item);
    const std::string item_name = std::string(name) + "[" + std::to_string(values.size()) + "]";
    values.push_back(int_argument(owned, function, item_name.c_str()));
  }
  if (PyErr_Occurred()) throw nb::python_error();
  return values;
}

namespace {

// The TypeError for an object no path could describe. A producer that has
// __dlpack__ but refused says why (NumPy: a byte order or a structured dtype
// DLPack has no code for), which beats "must be a tensor".
[[noreturn]] void not_a_tensor(const char* name, nb::handle obj, const char* why) {
  if (nb::hasattr(obj, "__dlpack__")) {
    std::string reason;
    // Only a producer's refusal is reported as one; KeyboardInterrupt and the
    // like go on as they are.
    const auto refusal = [](nb::python_error& e) {
      if (!e.matches(PyExc_Exception)) throw;
      return exception_text(e);
    };
    try {
      // Asked as nanobind asks (a versioned capsule, which can say read-only):
      // a producer that gives one failed for another reason, `why`.
      obj.attr("__dlpack__")(nb::arg("max_version") = nb::make_tuple(1, 0));
    } catch (nb::python_error& e) {
      if (!e.matches(PyExc_TypeError)) reason = refusal(e);  // TypeError: it predates max_version
      if (reason.empty()) {
        try {
          obj.attr("__dlpack__")();
        } catch (nb::python_error& plain) {
          reason = refusal(plain);
        }
      }
    }
    if (!reason.empty()) argument_error(name, "is a " + type_of(obj) + " that DLPack cannot describe: " + reason);
  }
  type_error(name, obj, why);
}

bool is_jax_array(PyTypeObject* type) {
  nb::object module = nb::getattr(nb::handle(reinterpret_cast<PyObject*>(type)), "__module__", nb::none());
  if (!nb::isinstance<nb::str>(module)) return false;
  const std::string_view name = nb::str(module).c_str();
  return name.substr(0, 4) == "jax." || name.substr(0, 7) == "jaxlib." || name == "jax" || name == "jaxlib";
}

// The producer's capsule, asked for here rather than by nanobind so that it
// is checked (check_capsule) before anything reads it. An output is asked
// for with copy=False: under the array API a producer may otherwise hand out
// a copy, which moecap would fill while the caller's array kept its old
// values. `stream` (non-None for a CUDA call) is the array API's stream=
// value. Producers predating copy= or max_version= raise TypeError and are
// asked without them. Invalid when `obj` has no __dlpack__ or the producer
// refuses for another reason (nanobind then asks as usual and reports it).
nb::object ask_capsule(nb::handle obj, const char* name, bool writable, nb::handle stream) {
  nb::object dlpack = nb::getattr(obj, "__dlpack__", nb::none());
  if (dlpack.is_none()) return {};
  const nb::object version = nb::make_tuple(1, 0);
  const auto ask = [&](bool with_version, bool without_copy) {
    nb::kwargs kwargs;
    if (!stream.is_none()) kwargs["stream"] = stream;
    if (with_version) kwargs["max_version"] = version;
    if (without_copy) kwargs["copy"] = false;
    return dlpack(**kwargs);
  };
  const auto predates = [](nb::python_error& e) {
    if (!e.matches(PyExc_TypeError)) throw;
  };
  try {
    if (writable) {
      try {
        return ask(true, true);
      } catch (nb::python_error& e) {
        if (e.matches(PyExc_BufferError)) {
          // The array API's answer when only a copy can be exported, and for
          // what DLPack cannot describe at all (byte order, dtype, strides):
          // the producer's words say which.
          argument_error(name, "is a " + type_of(obj) + " whose producer refused to export it in place, with "
                                   "copy=False (" + exception_text(e) + "): moecap writes outputs in place");
        }
        predates(e);
      }
    }
    try {
      return ask(true, false);
    } catch (nb::python_error& e) {
      predates(e);
    }
    return ask(false, false);
  } catch (nb::python_error& e) {
    if (!e.matches(PyExc_Exception)) throw;  // KeyboardInterrupt and the like go on
    // An output is never left to nanobind's own request, whose capsule is not checked for a copy.
    if (writable) argument_error(name, "is a " + type_of(obj) + " whose __dlpack__ refused: " + exception_text(e));
    return {};
  }
}

// DLPack's rules for a versioned capsule, which nanobind's import does not
// check: another major version may lay out every field after `version`
// otherwise, so it is refused unread (its capsule, unconsumed, calls the
// deleter); and an output exported as a copy (IS_COPIED) is refused, moecap
// would fill the copy. A legacy capsule says neither.
void check_capsule(nb::handle capsule, const char* name, bool writable) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor_versioned")) return;
  const auto* managed =
      static_cast<const DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor_versioned"));
  if (managed->version.major != 1) {
    argument_error(name, "is a DLPack " + std::to_string(managed->version.major) + "." +
                             std::to_string(managed->version.minor) +
                             " tensor; moecap reads DLPack 1.x (another major version may lay out its fields "
                             "otherwise)");
  }
  if (writable && (managed->flags & DLPACK_FLAG_BITMASK_IS_COPIED) != 0) {
    argument_error(name, "was exported as a copy (DLPack's IS_COPIED flag); moecap would write into the copy, "
                         "not into the array");
  }
}

// The array API's stream= value for a CUDA array of the call's GPU: under
// it the producer makes that stream wait for the array's pending work, where
// nanobind's own request (no stream=) would mean the legacy default stream,
// which moecap never enqueues on unless told to and which an engine's
// capture may not touch. None where there is no CUDA call or the producer
// reports its array elsewhere (on another GPU the call refuses it after the
// borrow; its producer is not asked to order work for ours).
nb::object stream_for_call(nb::handle obj, const CallStream* call) {
  if (call == nullptr || call->device_type != MOECAP_DEVICE_CUDA) return nb::none();
  nb::object dlpack_device = nb::getattr(obj, "__dlpack_device__", nb::none());
  if (dlpack_device.is_none()) return nb::none();
  int kind = -1, id = -1;
  try {
    nb::object device = dlpack_device();
    kind = nb::cast<int>(device[0]);
    id = nb::cast<int>(device[1]);
  } catch (nb::python_error& e) {
    if (!e.matches(PyExc_Exception)) throw;  // KeyboardInterrupt and the like go on
    return nb::none();
  } catch (nb::cast_error&) {
    return nb::none();
  }
  if ((kind != kDLCUDA && kind != kDLCUDAManaged) || id != call->device_id) return nb::none();
  // Without a stream (no stream=, no torch) this fails as the call would after the borrow.
  void* stream = resolve_stream(call->stream, call->device_type, call->device_id);
  // The array API's values: 1 is the legacy default stream (0 is not allowed).
  return nb::int_(stream == nullptr ? 1ull : static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)));
}

// What nanobind imports: a capsule given as the argument, or the producer's,
// checked; else the object itself (nanobind's buffer-protocol and to_dlpack
// paths, and its report of a producer's refusal).
nb::object import_source(nb::handle obj, const char* name, bool writable, const CallStream* call) {
  nb::object capsule = PyCapsule_CheckExact(obj.ptr()) ? nb::borrow(obj)
                                                       : ask_capsule(obj, name, writable, stream_for_call(obj, call));
  if (!capsule.is_valid()) return nb::borrow(obj);
  check_capsule(capsule, name, writable);
  return capsule;
}

}  // namespace

void borrow(nb::handle obj, const char* name, bool writable, Borrowed& out, const CallStream* call) {
  out.keep = nb::borrow(obj);
  out.dl.byte_offset = 0;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  const ExchangeApi* api = use_exchange_api ? exchange_api(type) : nullptr;
  // torch.Tensor's own exchange API (its subclasses' too, nn.Parameter's)
  // exports nothing read-only; the flags cost a managed export, 2 us a read.
  if (writable && api != nullptr && !(torch_ready() && api == torch_types.api)) {
    refuse_read_only_export(api, obj, name);
  }
  if (writable && torch_ready() && PyObject_TypeCheck(obj.ptr(), torch_types.tensor)) {
    // Written outside autograd, its version counter unchanged: a backward
    // through it would use the old values. torch refuses to export these.
    static PyObject* requires_grad = PyUnicode_InternFromString("requires_grad");
    const nb::object grad = torch_attribute(PyObject_GetAttr(obj.ptr(), requires_grad), name, "write");
    if (grad.ptr() == Py_True) {
      argument_error(name, "requires grad: moecap writes it outside autograd (pass a tensor without requires_grad, "
                           "or read into a new one)");
    }
  }
  if (api != nullptr && borrow_exchange(api, obj, name, out)) {
    out.producer_api = api;
    return;
  }
  if (use_torch_attributes && torch_ready() && PyObject_TypeCheck(obj.ptr(), torch_types.tensor)) {
    borrow_torch_attributes(obj, name, out);
    return;
  }
  if (PyObject_CheckBuffer(obj.ptr()) && borrow_buffer(obj, name, writable, out)) return;
  if (writable) {
    // JAX arrays are immutable, but their DLPack capsules are legacy ones,
    // which have no read-only flag: moecap would write into an array that
    // jitted code holds as a constant.
    if (is_jax_array(type)) {
      type_error(name, obj, "must be a writable tensor, and JAX arrays are immutable (read into NumPy or torch, "
                            "then jax.numpy.asarray)");
    }
    nb::ndarray<> array;
    if (!nb::try_cast(import_source(obj, name, true, call), array, false)) {
      not_a_tensor(name, obj, "must be a writable tensor (NumPy, PyTorch, CuPy or any DLPack producer)");
    }
    borrow_ndarray(array, out, name, obj);
    out.array = nb::ndarray<nb::ro>(array);
  } else {
    if (!nb::try_cast(import_source(obj, name, false, call), out.array, false)) {
      not_a_tensor(name, obj, "must be a tensor (NumPy, PyTorch, JAX, CuPy or any DLPack producer)");
    }
    borrow_ndarray(out.array, out, name, obj);
  }
}

const DLTensor* borrow_optional(nb::handle obj, const char* name, bool writable, Borrowed& out,
                                const CallStream* call) {
  if (obj.is_none()) return nullptr;
  borrow(obj, name, writable, out, call);
  return out.get();
}

void* resolve_stream(nb::handle stream, int32_t device_type, int32_t device_id, const Borrowed* tensor) {
  if (stream.is_none()) {
    if (device_type != MOECAP_DEVICE_CUDA) return nullptr;  // the host backend has no streams
    const ExchangeApi* api = tensor != nullptr ? static_cast<const ExchangeApi*>(tensor->producer_api) : nullptr;
    if (api == nullptr && torch_ready()) api = torch_types.api;
    if (api != nullptr && api->current_work_stream != nullptr) {
      void* current = nullptr;
      if (api->current_work_stream(kDLCUDA, device_id, &current) != 0) throw nb::python_error();
      return current;
    }
    if (torch_ready() && torch_types.raw_stream != nullptr) {
      nb::object current = nb::handle(torch_types.raw_stream)(device_id);
      return reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(current.ptr())));
    }
    throw nb::value_error(
        "moecap: stream=None on a CUDA capturer means the current stream of the tensor's producer (its DLPack "
        "exchange API gives none here), else torch's, and torch (with CUDA) is not imported: pass stream= (a "
        "CUstream as int, or an object with .cuda_stream)");
  }
  PyObject* value = stream.ptr();
  nb::object attribute;
  // A bool is an int to Python: True would be the legacy stream's handle 1, False the NULL stream.
  constexpr const char* kStreamKinds = "must be None, an int (CUstream) or an object with .cuda_stream";
  if (PyBool_Check(value)) type_error("stream", stream, kStreamKinds);
  if (!PyLong_Check(value)) {
    if (!nb::hasattr(stream, "cuda_stream")) type_error("stream", stream, kStreamKinds);
    attribute = stream.attr("cuda_stream");
    value = attribute.ptr();
  }
  const unsigned long long handle = PyLong_AsUnsignedLongLong(value);
  if (PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw nb::python_error();
    PyErr_Clear();  // negative, or past 64 bits: no stream handle
    raise_error(MOECAP_ERROR_INVALID_ARGUMENT, "stream is " + nb::cast<std::string>(nb::str(nb::handle(value))) +
                                                   "; a CUstream handle is in [0, 2^64)");
  }
  return reinterpret_cast<void*>(static_cast<uintptr_t>(handle));
}

void set_fast_paths(bool exchange_api_enabled, bool torch_attributes_enabled) {
  use_exchange_api = exchange_api_enabled;
  use_torch_attributes = torch_attributes_enabled;
}

}  // namespace moecap_python
