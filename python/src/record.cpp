// SPDX-License-Identifier: Apache-2.0
// The routing record (abi/moecap_record.h) from Python: moecap.record's
// RoutedExperts.to_bytes / from_bytes call these, so the bytes are written
// and checked by the library's own codec and nowhere else.
#include <nanobind/stl/optional.h>

#include <optional>
#include <cstring>
#include <vector>

#include "binding.h"
#include "graphs/element.h"
#include "moecap_record.h"
#include "plugin/tensor_args.h"

namespace moecap_python {
namespace {

// A bytes-like object's memory (bytes, bytearray, memoryview, a NumPy uint8
// array), held for the duration of a call.
class ReadOnlyBuffer {
 public:
  explicit ReadOnlyBuffer(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw nb::type_error("moecap: argument 'data' must be a bytes-like object (bytes, bytearray, memoryview)");
    }
  }
  ReadOnlyBuffer(const ReadOnlyBuffer&) = delete;
  ReadOnlyBuffer& operator=(const ReadOnlyBuffer&) = delete;
  ~ReadOnlyBuffer() { PyBuffer_Release(&view_); }
  const void* data() const { return view_.buf; }
  uint64_t size() const { return static_cast<uint64_t>(view_.len); }

 private:
  Py_buffer view_{};
};

int32_t weight_elem(moecap_weight_dtype dtype) {
  switch (dtype) {
    case MOECAP_WEIGHTS_F32: return moecap::kF32;
    case MOECAP_WEIGHTS_BF16: return moecap::kBF16;
    case MOECAP_WEIGHTS_F16: return moecap::kF16;
    default: throw nb::value_error("moecap: weight_dtype must be F32, BF16 or F16");
  }
}

int32_t float_elem(const DLTensor& t) {
  if (t.dtype.lanes == 1 && t.dtype.code == kDLFloat && t.dtype.bits == 32) return moecap::kF32;
  if (t.dtype.lanes == 1 && t.dtype.code == kDLFloat && t.dtype.bits == 16) return moecap::kF16;
  if (t.dtype.lanes == 1 && t.dtype.code == kDLBfloat && t.dtype.bits == 16) return moecap::kBF16;
  return -1;
}

// Weights in the dtype the record is to store, converted by the library's own
// element conversions (graphs/element.h: the rounding the kernels use), so
// the Python package has no float rounding of its own. `storage` receives
// the converted values; the returned tensor points into it or is `weights`.
const DLTensor* stored_weights(const Borrowed& weights, moecap_weight_dtype dtype, std::vector<uint8_t>& storage,
                               DLTensor& converted) {
  const DLTensor& w = *weights.get();
  const int32_t from = float_elem(w);
  const int32_t to = weight_elem(dtype);
  if (from == to) return &w;
  if (from < 0) throw nb::type_error("moecap: argument 'weights' must be float32, bfloat16 or float16");
  // Pinned host memory is host memory.
  const int32_t device_type = moecap::device_kind(w.device);
  if (device_type != kDLCPU && device_type != kDLCUDAHost) {
    throw nb::value_error("moecap: argument 'weights' must be in host memory (CPU or pinned) to be converted");
  }
  int64_t count = 1, expected_stride = 1;
  for (int32_t d = w.ndim - 1; d >= 0; --d) {
    if (w.strides != nullptr && w.shape[d] > 1 && w.strides[d] != expected_stride) {
      throw nb::value_error("moecap: argument 'weights' must be compact row-major");
    }
    expected_stride *= w.shape[d];
    count *= w.shape[d];
  }
  storage.resize(static_cast<size_t>(count) * static_cast<size_t>(moecap::elem_bytes(to)));
  const void* src = static_cast<const uint8_t*>(w.data) + w.byte_offset;
  for (int64_t i = 0; i < count; ++i) moecap::store_float(storage.data(), to, i, moecap::load_float(src, from, i));
  converted = w;
  converted.data = storage.data();
  converted.byte_offset = 0;
  converted.strides = nullptr;
  converted.dtype = to == moecap::kF32 ? DLDataType{kDLFloat, 32, 1}
                                        : DLDataType{static_cast<uint8_t>(to == moecap::kBF16 ? kDLBfloat : kDLFloat), 16, 1};
  return &converted;
}

nb::bytes record_encode(Tensor ids, int32_t num_experts, Tensor weights, Tensor valid,
                        int64_t start_position, bool packed, std::optional<moecap_weight_dtype> weight_dtype) {
  Borrowed i, w, v;
  borrow(ids, "ids", false, i);
  const DLTensor* wp = borrow_optional(weights, "weights", false, w);
  std::vector<uint8_t> storage;
  DLTensor converted{};
  if (wp != nullptr && weight_dtype) wp = stored_weights(w, *weight_dtype, storage, converted);
  moecap_record_source source{sizeof(moecap_record_source),
                              packed ? MOECAP_RECORD_PACKED : 0u,
                              num_experts,
                              start_position,
                              i.get(),
                              wp,
                              borrow_optional(valid, "valid", false, v)};
  uint64_t size = 0;
  check(moecap_record_size(&source, &size));
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
  if (out == nullptr) throw nb::python_error();
  nb::bytes result = nb::steal<nb::bytes>(out);
  moecap_status status;
  {
    GilRelease unlocked;  // the inputs are held by i, w, v; the bytes are ours alone
    status = moecap_record_encode(&source, PyBytes_AS_STRING(out), size, nullptr);
  }
  check(status);
  return result;
}

nb::dict record_parse(nb::handle data) {
  ReadOnlyBuffer buffer(data);
  moecap_record_info info{};
  info.struct_size = sizeof info;
  moecap_status status;
  {
    GilRelease unlocked;
    status = moecap_record_parse(buffer.data(), buffer.size(), &info);
  }
  check(status);
  nb::dict d;
  d["version"] = info.version;
  d["flags"] = info.flags;
  d["id_bits"] = info.id_bits;
  d["weight_dtype"] = static_cast<moecap_weight_dtype>(info.weight_dtype);
  d["num_layers"] = info.num_layers;
  d["top_k"] = info.top_k;
  d["num_experts"] = info.num_experts;
  d["num_tokens"] = info.num_tokens;
  d["start_position"] = info.start_position;
  d["bytes"] = info.bytes;
  return d;
}

void record_decode(nb::handle data, Tensor ids_out, Tensor weights_out, Tensor valid_out) {
  ReadOnlyBuffer buffer(data);
  Borrowed i, w, v;
  borrow(ids_out, "ids_out", true, i);
  DLTensor* wp = const_cast<DLTensor*>(borrow_optional(weights_out, "weights_out", true, w));
  DLTensor* vp = const_cast<DLTensor*>(borrow_optional(valid_out, "valid_out", true, v));
  moecap_status status;
  {
    GilRelease unlocked;
    status = moecap_record_decode(buffer.data(), buffer.size(), i.get_mut(), wp, vp);
  }
  check(status);
}

}  // namespace

void bind_record(nb::module_& m) {
  m.def("record_encode", &record_encode, nb::arg("ids"), nb::arg("num_experts"), nb::arg("weights").none() = nb::none(),
        nb::arg("valid").none() = nb::none(), nb::arg("start_position") = 0, nb::arg("packed") = true,
        nb::arg("weight_dtype") = nb::none(),
        "moecap_record_encode: the record of ids [tokens, layers, top_k] (int8..int64, -1 = no expert), "
        "weights (float32/bfloat16/float16, stored as weight_dtype, or as given when None) and valid "
        "([tokens] uint8), all host memory.");
  m.def("record_parse", &record_parse, nb::arg("data"),
        "moecap_record_parse: checks a whole record and returns its header (moecap_record_info) as a dict.");
  m.def("record_decode", &record_decode, nb::arg("data"), nb::arg("ids_out"), nb::arg("weights_out").none() = nb::none(),
        nb::arg("valid_out").none() = nb::none(),
        "moecap_record_decode into caller arrays (host memory, compact): ids_out int8..int64, "
        "weights_out float32/bfloat16/float16, valid_out uint8.");
}

}  // namespace moecap_python
