/* SPDX-License-Identifier: Apache-2.0 */
// The engine's stream, as the C ABI hands it over: a CUstream (cudaStream_t)
// on the CUDA backend, ignored by the host backend. moecap enqueues its work
// on it and creates nothing on it. The ABI's NULL is the legacy default
// stream; inside the library that case is spelled legacy_default() and asked
// with is_legacy_default(), never a bare pointer compared with nullptr.
#pragma once

namespace moecap {

class EngineStream {
 public:
  // The stream argument of a moecap_* call, as given.
  static EngineStream from_abi(void* stream) { return EngineStream(stream); }
  static EngineStream legacy_default() { return EngineStream(nullptr); }

  bool is_legacy_default() const { return handle_ == nullptr; }
  // The CUstream, or nullptr for the legacy default stream.
  void* handle() const { return handle_; }

  friend bool operator==(EngineStream a, EngineStream b) { return a.handle_ == b.handle_; }
  friend bool operator!=(EngineStream a, EngineStream b) { return a.handle_ != b.handle_; }

 private:
  explicit EngineStream(void* handle) : handle_(handle) {}
  void* handle_;
};

}  // namespace moecap
