// Python tensors in, as borrowed DLTensors; streams; errors out.
#include <cstring>
#include <string>

#include "binding.h"

namespace moecap_python {
namespace {

// What we know about PyTorch once it is imported. Looked up on first use
// after `import torch` (moecap never imports torch itself for a call).
struct TorchTypes {
  bool known = false;
  PyTypeObject* tensor = nullptr;
  struct Dtype {
    PyObject* object;
    DLDataType dl;
  };
  Dtype dtypes[12]{};
  int num_dtypes = 0;
  PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream(device) -> int
};
// Plain pointers, never released: a static nb::object would be destroyed
// after the interpreter finalized.
TorchTypes torch_types;

bool torch_ready() {
  if (torch_types.known) return true;
  PyObject* modules = PyImport_GetModuleDict();
  PyObject* torch = PyDict_GetItemString(modules, "torch");  // borrowed; no import
  if (torch == nullptr) return false;
  nb::handle t(torch);
  if (!nb::hasattr(t, "Tensor") || !nb::hasattr(t, "bfloat16")) return false;  // torch mid-import
  torch_types.tensor = reinterpret_cast<PyTypeObject*>(t.attr("Tensor").ptr());
  struct {
    const char* name;
    uint8_t code, bits;
  } table[] = {{"int8", kDLInt, 8},      {"int16", kDLInt, 16},       {"int32", kDLInt, 32},
               {"int64", kDLInt, 64},    {"uint8", kDLUInt, 8},       {"uint16", kDLUInt, 16},
               {"uint32", kDLUInt, 32},  {"float16", kDLFloat, 16},   {"float32", kDLFloat, 32},
               {"float64", kDLFloat, 64}, {"bfloat16", kDLBfloat, 16}, {"bool", 6 /* kDLBool, DLPack >= 0.8 */, 8}};
  for (const auto& d : table) {
    if (!nb::hasattr(t, d.name)) continue;  // uint16/uint32 are torch >= 2.3
    torch_types.dtypes[torch_types.num_dtypes++] = {t.attr(d.name).ptr(), DLDataType{d.code, d.bits, 1}};
  }
  nb::object c = t.attr("_C");
  if (nb::hasattr(c, "_cuda_getCurrentRawStream")) {
    torch_types.raw_stream = nb::object(c.attr("_cuda_getCurrentRawStream")).release().ptr();
  }
  torch_types.known = true;  // torch is never unloaded: the borrowed type and dtype objects stay valid
  return true;
}

[[noreturn]] void type_error(const char* name, nb::handle obj, const char* why) {
  std::string type = nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())))));
  throw nb::type_error(("moecap: argument '" + std::string(name) + "' " + why + ", not " + type).c_str());
}

int copy_tuple(nb::handle tuple, int64_t* out, const char* name, nb::handle obj) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple.ptr());
  if (n > Borrowed::kMaxDims) type_error(name, obj, "has more than 8 dimensions");
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple.ptr(), i));
  return static_cast<int>(n);
}

// torch.Tensor: data_ptr(), shape, stride(), dtype and device read directly.
void borrow_torch(nb::handle obj, const char* name, Borrowed& out) {
  // Interned once and kept for the life of the process (see TorchTypes).
  static nb::handle data_ptr = PyUnicode_InternFromString("data_ptr"), shape = PyUnicode_InternFromString("shape"),
                    stride = PyUnicode_InternFromString("stride"), dtype = PyUnicode_InternFromString("dtype"),
                    is_cuda = PyUnicode_InternFromString("is_cuda"),
                    get_device = PyUnicode_InternFromString("get_device");
  PyObject* dt = nb::getattr(obj, dtype).ptr();
  const TorchTypes::Dtype* found = nullptr;
  for (int i = 0; i < torch_types.num_dtypes; ++i) {
    if (torch_types.dtypes[i].object == dt) found = &torch_types.dtypes[i];
  }
  if (found == nullptr) type_error(name, obj, "has a dtype DLPack cannot describe");
  out.dl.dtype = found->dl;
  out.dl.ndim = copy_tuple(nb::getattr(obj, shape), out.shape, name, obj);
  copy_tuple(obj.attr(stride)(), out.strides, name, obj);
  out.dl.data = reinterpret_cast<void*>(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(obj.attr(data_ptr)().ptr())));
  if (nb::getattr(obj, is_cuda).ptr() == Py_True) {
    out.dl.device = DLDevice{kDLCUDA, static_cast<int32_t>(nb::cast<int>(obj.attr(get_device)()))};
  } else {
    out.dl.device = DLDevice{kDLCPU, 0};
  }
  out.keep = nb::borrow(obj);
}

template <class Array>
void fill_from(const Array& a, Borrowed& out, const char* name, nb::handle obj) {
  if (a.ndim() > static_cast<size_t>(Borrowed::kMaxDims)) type_error(name, obj, "has more than 8 dimensions");
  out.dl.data = const_cast<void*>(static_cast<const void*>(a.data()));
  out.dl.ndim = static_cast<int32_t>(a.ndim());
  auto dt = a.dtype();
  out.dl.dtype = DLDataType{dt.code, dt.bits, dt.lanes};
  out.dl.device = DLDevice{static_cast<DLDeviceType>(a.device_type()), static_cast<int32_t>(a.device_id())};
  int64_t compact = 1;
  for (int i = out.dl.ndim - 1; i >= 0; --i) {
    out.shape[i] = a.shape_ptr()[i];
    out.strides[i] = a.stride_ptr() != nullptr ? a.stride_ptr()[i] : compact;
    compact *= out.shape[i];
  }
  out.keep = nb::borrow(obj);
}

}  // namespace

void check(moecap_status status) {
  if (status == MOECAP_OK) return;
  std::string message = moecap_last_error();
  nb::object cls = nb::module_::import_("moecap._errors").attr("MoecapError");
  nb::object error = cls(static_cast<int>(status), message);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw nb::python_error();
}

void borrow(nb::handle obj, const char* name, bool writable, Borrowed& out) {
  out.dl.shape = out.shape;
  out.dl.strides = out.strides;
  out.dl.byte_offset = 0;
  if (torch_ready() && PyObject_TypeCheck(obj.ptr(), torch_types.tensor)) {
    borrow_torch(obj, name, out);
    return;
  }
  if (writable) {
    nb::ndarray<> array;
    if (!nb::try_cast(obj, array, false)) {
      type_error(name, obj, "must be a writable tensor (NumPy, PyTorch, JAX, CuPy or any DLPack producer)");
    }
    fill_from(array, out, name, obj);
    out.array = nb::ndarray<nb::ro>(array);
  } else {
    if (!nb::try_cast(obj, out.array, false)) {
      type_error(name, obj, "must be a tensor (NumPy, PyTorch, JAX, CuPy or any DLPack producer)");
    }
    fill_from(out.array, out, name, obj);
  }
}

const DLTensor* borrow_optional(nb::handle obj, const char* name, bool writable, Borrowed& out) {
  if (obj.is_none()) return nullptr;
  borrow(obj, name, writable, out);
  return out.get();
}

void* resolve_stream(nb::handle stream, int32_t device_type, int32_t device_id) {
  if (stream.is_none()) {
    if (device_type != MOECAP_DEVICE_CUDA) return nullptr;  // the host backend has no streams
    if (!torch_ready() || torch_types.raw_stream == nullptr) {
      throw nb::value_error(
          "moecap: stream=None on a CUDA capturer means torch's current stream, and torch (with CUDA) is not "
          "imported: pass stream= (a CUstream as int, or an object with .cuda_stream)");
    }
    return reinterpret_cast<void*>(
        static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(nb::handle(torch_types.raw_stream)(device_id).ptr())));
  }
  PyObject* value = stream.ptr();
  nb::object attribute;
  if (!PyLong_Check(value)) {
    if (!nb::hasattr(stream, "cuda_stream")) {
      type_error("stream", stream, "must be None, an int (CUstream) or an object with .cuda_stream");
    }
    attribute = stream.attr("cuda_stream");
    value = attribute.ptr();
  }
  unsigned long long handle = PyLong_AsUnsignedLongLong(value);
  if (PyErr_Occurred()) throw nb::python_error();
  return reinterpret_cast<void*>(static_cast<uintptr_t>(handle));
}

}  // namespace moecap_python
