// SPDX-License-Identifier: Apache-2.0
// DLPackView: a moecap buffer going out through the Python DLPack protocol
// (array API 2023.12): versioned capsules when the consumer asks for them
// (max_version), legacy ones otherwise, copy=True copies, dl_device is
// checked, and a capsule nobody consumed frees the view in its destructor.
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <string_view>

#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "binding.h"

namespace moecap_python {
namespace {

constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kLegacyName = "dltensor";

void release(DLManagedTensorVersioned* m) {
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

// Capsule destructors. A consumer that took the tensor renamed the capsule
// ("used_dltensor...") and owns the deleter call; an unconsumed one (a
// consumer that refused it, or nobody asked) still owns it. PyCapsule_IsValid
// never sets an error, so a pending exception survives.
void versioned_capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kVersionedName)) {
    release(static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersionedName)));
  }
}
void legacy_capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kLegacyName)) {
    auto* legacy = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kLegacyName));
    legacy->deleter(legacy);
  }
}

// A legacy DLManagedTensor in front of a versioned one (which it owns).
DLManagedTensor* to_legacy(DLManagedTensorVersioned* m) {
  auto* legacy = new DLManagedTensor{};
  legacy->dl_tensor = m->dl_tensor;
  legacy->manager_ctx = m;
  legacy->deleter = [](DLManagedTensor* self) {
    release(static_cast<DLManagedTensorVersioned*>(self->manager_ctx));
    delete self;
  };
  return legacy;
}

// A NumPy bool (numpy.True_) as the bool it holds, as moecap's own flags take
// it; anything else is left to the caller's error.
bool numpy_bool(nb::handle value, bool& out) {
  const std::string_view type = Py_TYPE(value.ptr())->tp_name;
  if (type != "numpy.bool" && type != "numpy.bool_") return false;
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw nb::python_error();
  out = truth != 0;
  return true;
}

// A compact, 64-byte aligned host copy of a host tensor (copy=True).
struct HostCopy {
  DLManagedTensorVersioned managed{};
  int64_t shape[Borrowed::kMaxDims]{};
  int64_t strides[Borrowed::kMaxDims]{};
};

DLManagedTensorVersioned* copy_to_host(const DLTensor& src) {
  if (src.ndim > Borrowed::kMaxDims) throw nb::buffer_error("moecap: copy=True of a view with more than 8 dimensions");
  const size_t item = (static_cast<size_t>(src.dtype.bits) * src.dtype.lanes + 7) / 8;
  size_t count = 1;
  for (int i = 0; i < src.ndim; ++i) count *= static_cast<size_t>(src.shape[i]);
  const size_t bytes = (count * item + 63) / 64 * 64;
  void* data = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (data == nullptr) throw std::bad_alloc();
  auto* copy = new HostCopy{};
  copy->managed.version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  copy->managed.manager_ctx = copy;
  copy->managed.flags = DLPACK_FLAG_BITMASK_IS_COPIED;
  copy->managed.deleter = [](DLManagedTensorVersioned* self) {
    auto* owner = static_cast<HostCopy*>(self->manager_ctx);
    std::free(owner->managed.dl_tensor.data);
    delete owner;
  };
  DLTensor& t = copy->managed.dl_tensor;
  t = src;
  t.data = data;
  t.byte_offset = 0;
  t.shape = copy->shape;
  t.strides = copy->strides;
  int64_t compact = 1;
  for (int i = src.ndim - 1; i >= 0; --i) {
    copy->shape[i] = src.shape[i];
    copy->strides[i] = compact;
    compact *= src.shape[i];
  }
  // Element by element in row-major order through the source strides.
  const char* base = static_cast<const char*>(src.data) + src.byte_offset;
  int64_t index[Borrowed::kMaxDims] = {};
  for (size_t n = 0; n < count; ++n) {
    int64_t offset = 0;
    for (int i = 0; i < src.ndim; ++i) offset += index[i] * (src.strides != nullptr ? src.strides[i] : copy->strides[i]);
    std::memcpy(static_cast<char*>(data) + n * item, base + offset * static_cast<int64_t>(item), item);
    for (int i = src.ndim - 1; i >= 0; --i) {
      if (++index[i] < src.shape[i]) break;
      index[i] = 0;
    }
  }
  return &copy->managed;
}

bool is_host(DLDeviceType type) { return type == kDLCPU || type == kDLCUDAHost; }

}  // namespace

class DLPackView {
 public:
  explicit DLPackView(DLManagedTensorVersioned* managed) : managed_(managed) {
    const DLTensor& t = managed->dl_tensor;
    device_ = t.device;
    dtype_ = t.dtype;
    shape_ = nb::tuple(nb::cast(std::vector<int64_t>(t.shape, t.shape + t.ndim)));
    strides_ = nb::tuple(nb::cast(std::vector<int64_t>(t.strides, t.strides + t.ndim)));
  }
  DLPackView(const DLPackView&) = delete;
  DLPackView& operator=(const DLPackView&) = delete;
  ~DLPackView() { release(managed_); }

  std::pair<int, int> dlpack_device() const { return {static_cast<int>(device_.device_type), device_.device_id}; }

  nb::capsule dlpack(nb::handle stream, nb::handle max_version, nb::handle dl_device, nb::handle copy) {
    // Every keyword is converted before the view is looked at: a conversion
    // can run Python code (__index__, __bool__), which may consume this view.
    // The stream is only checked: moecap's buffers are written in the engine's
    // stream order, which the consumer already follows (PYTHON.md).
    long long stream_value = 0;
    if (!stream.is_none() && (PyBool_Check(stream.ptr()) || !nb::try_cast(stream, stream_value))) {
      throw nb::type_error("moecap: DLPackView.__dlpack__: stream must be None or an int");
    }
    std::pair<int, int> wanted{}, version{};
    if (!dl_device.is_none() && !nb::try_cast(dl_device, wanted)) {
      throw nb::type_error("moecap: DLPackView.__dlpack__: dl_device must be a (device_type, device_id) pair of ints");
    }
    if (!max_version.is_none() && !nb::try_cast(max_version, version)) {
      throw nb::type_error("moecap: DLPackView.__dlpack__: max_version must be a (major, minor) pair of ints");
    }
    if (!max_version.is_none() && (version.first < 0 || version.second < 0)) {
      throw nb::value_error(("moecap: DLPackView.__dlpack__: max_version is (" + std::to_string(version.first) +
                             ", " + std::to_string(version.second) + "); a DLPack version has no negative part")
                                .c_str());
    }
    bool copied = false;
    if (!copy.is_none() && !nb::try_cast(copy, copied) && !numpy_bool(copy, copied)) {
      throw nb::type_error("moecap: DLPackView.__dlpack__: copy must be None, True or False");
    }
    if (managed_ == nullptr) throw nb::buffer_error("moecap: this DLPackView was already consumed (export again)");
    const bool cuda = device_.device_type == kDLCUDA || device_.device_type == kDLCUDAManaged;
    if (!stream.is_none() && !cuda) {  // the array API: a device without streams takes None only
      throw nb::buffer_error(("moecap: the view lives on device type " + std::to_string(device_.device_type) +
                              ", which has no streams; stream must be None, not " + std::to_string(stream_value))
                                 .c_str());
    }
    if (!stream.is_none() && stream_value == 0) {
      throw nb::buffer_error("moecap: stream=0 is ambiguous and the array API refuses it (1 is the legacy default "
                             "stream, 2 the per-thread one)");
    }
    if (!dl_device.is_none()) {
      if (wanted.first != static_cast<int>(device_.device_type) || wanted.second != device_.device_id) {
        throw nb::buffer_error(("moecap: the view lives on device (" + std::to_string(device_.device_type) + ", " +
                                std::to_string(device_.device_id) + "); dl_device asks for (" +
                                std::to_string(wanted.first) + ", " + std::to_string(wanted.second) + ")")
                                   .c_str());
      }
    }
    const bool versioned = !max_version.is_none() && version.first >= 1;
    DLManagedTensorVersioned* out = managed_;
    if (copied) {
      if (!is_host(device_.device_type)) {
        throw nb::buffer_error("moecap: copy=True of a device buffer is not supported; take the view and copy "
                               "it in the consumer (torch.from_dlpack(view).clone())");
      }
      out = copy_to_host(managed_->dl_tensor);
      release(managed_);
    }
    managed_ = nullptr;  // the capsule owns it from here
    PyObject* capsule = nullptr;
    if (versioned) {
      capsule = PyCapsule_New(out, kVersionedName, versioned_capsule_destructor);
      if (capsule == nullptr) release(out);
    } else {
      DLManagedTensor* legacy = to_legacy(out);
      capsule = PyCapsule_New(legacy, kLegacyName, legacy_capsule_destructor);
      if (capsule == nullptr) legacy->deleter(legacy);
    }
    if (capsule == nullptr) throw nb::python_error();
    return nb::steal<nb::capsule>(capsule);
  }

  bool consumed() const { return managed_ == nullptr; }
  nb::tuple shape() const { return shape_; }
  nb::tuple strides() const { return strides_; }
  nb::tuple dtype() const { return nb::make_tuple(dtype_.code, dtype_.bits, dtype_.lanes); }

 private:
  DLManagedTensorVersioned* managed_;
  DLDevice device_{};
  DLDataType dtype_{};
  nb::tuple shape_, strides_;
};

nb::object make_dlpack_view(DLManagedTensorVersioned* managed) {
  return nb::cast(new DLPackView(managed), nb::rv_policy::take_ownership);
}

void bind_dlpack_view(nb::module_& m) {
  nb::class_<DLPackView>(m, "DLPackView",
                         "A zero-copy view of a moecap buffer for any DLPack consumer (numpy/torch/jax "
                         "from_dlpack). It keeps the capturer's memory alive until consumed and released, even "
                         "after Capturer.close(); it can be consumed once.")
      .def("__dlpack__", &DLPackView::dlpack, nb::kw_only(), nb::arg("stream") = nb::none(),
           nb::arg("max_version") = nb::none(), nb::arg("dl_device") = nb::none(), nb::arg("copy") = nb::none(),
           "A versioned capsule when max_version >= (1, 0), else a legacy one; copy=True copies host buffers.")
      .def("__dlpack_device__", &DLPackView::dlpack_device)
      .def_prop_ro("shape", &DLPackView::shape, "Elements per dimension.")
      .def_prop_ro("strides", &DLPackView::strides, "Strides in elements.")
      .def_prop_ro("dtype", &DLPackView::dtype, "(DLPack type code, bits, lanes).")
      .def_prop_ro("consumed", &DLPackView::consumed, "True once __dlpack__ handed the buffer out.");
}

}  // namespace moecap_python
