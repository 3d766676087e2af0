/* SPDX-License-Identifier: Apache-2.0 */
// Shared pieces of the moecap._moecap extension: borrowing Python tensors as
// DLTensors, resolving streams, raising MoecapError, and the DLPackView type.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "moecap.h"

namespace moecap_python {

namespace nb = nanobind;

inline bool any_object(PyObject*) { return true; }

// A tensor argument: anything borrow() takes (checked there, with the
// argument's name). A type of its own only so that the generated stubs say
// what a caller passes (moecap.DLPackArray: NumPy, PyTorch, JAX, CuPy, ...)
// instead of `object`.
class Tensor : public nb::object {
  NB_OBJECT_DEFAULT(Tensor, nb::object, "moecap.DLPackArray", any_object)
};

// Releases the GIL for a call that does not touch Python objects, as
// nb::gil_scoped_release does, except for a thread Python ends while it takes
// the GIL back during finalization: Python (<= 3.13) does that with
// pthread_exit, whose unwinding through a destructor (noexcept) aborted the
// process. That thread waits instead for the process to exit, as Python 3.14
// makes such threads wait.
// `in_flight`, where given, counts the call in progress: from before the GIL
// is released until the call is over, before the GIL is taken back, so that
// a thread Python parks there at exit is not counted forever (module.cpp's
// Capturer::close() waits for the count).
class GilRelease {
 public:
  explicit GilRelease(std::atomic<int>* in_flight = nullptr) : in_flight_(in_flight) {
    if (in_flight_ != nullptr) ++*in_flight_;
    state_ = PyEval_SaveThread();
  }
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  std::atomic<int>* in_flight_;
  PyThreadState* state_;
};

// Raises moecap.MoecapError(status, message).
[[noreturn]] void raise_error(moecap_status status, const std::string& message);

// Raises moecap.MoecapError(status, moecap_last_error()) unless status is OK,
// the message in Python's terms: a field is `ids.shape[1]`, not `ids->shape[1]`.
void check(moecap_status status);

// The same, also naming the Python method's arguments where its C call names
// them otherwise: each {c_name, python_name} pair is replaced first.
struct Rename {
  const char* c_name;
  const char* python_name;
};
void check(moecap_status status, std::initializer_list<Rename> renames);

// `value` for a C argument of type int32_t; a Python int beyond it is
// refused as the library refuses a value out of range (OUT_OF_RANGE, naming
// `function` and the argument `name`), not by nanobind's TypeError.
int32_t as_int32(int64_t value, const char* function, const char* name);

// An integer argument: taken as an object, so that int_argument (not
// nanobind's int caster, which takes True as 1 and answers 2.0 or 2**64 with
// a TypeError naming no argument) checks it. `typing.SupportsIndex` in the
// generated stubs (None is still refused by nanobind's own TypeError).
class Index : public nb::object {
  NB_OBJECT_DEFAULT(Index, nb::object, "typing.SupportsIndex", any_object)
};

// An integer argument taken as a handle: anything with __index__ (int, NumPy
// and 0-d torch integers). A bool (Python's, NumPy's or a 0-d torch bool) or
// another type raises TypeError and a value beyond int64 OUT_OF_RANGE, both
// naming `function` and the argument `name`.
int64_t int_argument(nb::handle value, const char* function, const char* name);

// The same, for a C argument of type int32_t (as_int32's range check).
int32_t int32_argument(nb::handle value, const char* function, const char* name);

// A sequence of integer arguments, checked by int_list.
class IndexSequence : public nb::object {
  NB_OBJECT_DEFAULT(IndexSequence, nb::object, "collections.abc.Sequence[typing.SupportsIndex] | moecap.DLPackArray", any_object)
};

// A sequence of integer arguments (a list, a tuple, a 1-D NumPy array or
// tensor), each checked as int_argument checks one and named `name[i]`; None,
// a str and anything not iterable raise TypeError naming `name`.
std::vector<int64_t> int_list(nb::handle value, const char* function, const char* name);

// A DLTensor describing a Python tensor's memory in place (no copy). `keep`
// holds the Python object, so the memory lives at least as long as this.
struct Borrowed {
  static constexpr int kMaxDims = 8;
  DLTensor dl{};
  int64_t shape[kMaxDims]{};
  int64_t strides[kMaxDims]{};
  nb::object keep;
  nb::ndarray<nb::ro> array;  // the nanobind import holding the producer's capsule
  Py_buffer buffer{};         // the buffer-protocol view, released with this
  bool has_buffer = false;
  const void* producer_api = nullptr;  // the producer's DLPack exchange API, if it came through one

  Borrowed() = default;
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  ~Borrowed() { release_buffer(); }  // with the GIL held, as every caller destroys it
  void release_buffer();

  const DLTensor* get() const { return &dl; }
  DLTensor* get_mut() { return &dl; }
};

// The stream a call enqueues on, as its arguments give it: what a CUDA
// array's producer without torch's exchange API (CuPy, JAX) is asked to
// order its pending work before (the array API's __dlpack__(stream=)).
struct CallStream {
  nb::handle stream;  // the call's stream= argument
  int32_t device_type;
  int32_t device_id;
};

// Fills `out` from a PyTorch tensor (attributes read directly: no DLPack
// round trip, no stream synchronization) or from anything nanobind's ndarray
// accepts (NumPy's buffer protocol, any __dlpack__ producer, a capsule).
// `name` names the argument in the TypeError; `writable` refuses read-only
// arrays (outputs). With `call` on a CUDA capturer, an array a producer
// reports on a CUDA device is exported for the call's stream; without it
// (or on the host backend), as nanobind asks: stream=None, which on CUDA
// means the legacy default stream.
void borrow(nb::handle obj, const char* name, bool writable, Borrowed& out, const CallStream* call = nullptr);

// Borrows `obj` unless it is None; returns the DLTensor or nullptr.
const DLTensor* borrow_optional(nb::handle obj, const char* name, bool writable, Borrowed& out,
                                const CallStream* call = nullptr);

// The CUstream for a call: an int, an object with .cuda_stream (torch, CuPy),
// or None: NULL for the host backend; for the CUDA backend the current stream
// of the producer of `tensor` (through its DLPack exchange API), else
// torch's current stream on the capturer's GPU; never silently the legacy
// stream.
void* resolve_stream(nb::handle stream, int32_t device_type, int32_t device_id, const Borrowed* tensor = nullptr);

// Test hook: turn the DLPack C exchange API and PyTorch attribute paths off
// to exercise the slower ones.
void set_fast_paths(bool exchange_api, bool torch_attributes);

// Wraps a DLManagedTensorVersioned from moecap_export (ownership moves in).
nb::object make_dlpack_view(DLManagedTensorVersioned* managed);
void bind_dlpack_view(nb::module_& m);

// record_encode / record_parse / record_decode (abi/moecap_record.h).
void bind_record(nb::module_& m);

}  // namespace moecap_python
