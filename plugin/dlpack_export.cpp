// SPDX-License-Identifier: Apache-2.0
// DLPack views of the capturer's buffers. The manager context owns a
// reference to the capturer, so memory outlives moecap_destroy until the
// consumer calls the deleter.
#include <cstring>
#include <memory>

#include "plugin/handles.h"

namespace moecap {
namespace {

struct ExportContext {
  std::shared_ptr<Capturer> owner;
  int64_t shape[3];
  int64_t strides[3];
  DLManagedTensorVersioned versioned;
  DLManagedTensor legacy;
};

ExportContext* make_context(const std::shared_ptr<Capturer>& owner, const BufferView& v) {
  auto ctx = std::make_unique<ExportContext>();
  ctx->owner = owner;
  std::memcpy(ctx->shape, v.shape, sizeof ctx->shape);
  std::memcpy(ctx->strides, v.strides, sizeof ctx->strides);
  return ctx.release();
}

DLTensor tensor_of(ExportContext* ctx, const BufferView& v) {
  DLTensor t{};
  t.data = v.data;
  t.device = v.device;
  t.ndim = v.ndim;
  t.dtype = v.dtype;
  t.shape = ctx->shape;
  t.strides = ctx->strides;
  t.byte_offset = 0;
  return t;
}

}  // namespace

DLManagedTensorVersioned* export_versioned(const std::shared_ptr<Capturer>& owner, const BufferView& v) {
  ExportContext* ctx = make_context(owner, v);
  DLManagedTensorVersioned& m = ctx->versioned;
  m.version.major = DLPACK_MAJOR_VERSION;
  m.version.minor = DLPACK_MINOR_VERSION;
  m.manager_ctx = ctx;
  m.deleter = [](DLManagedTensorVersioned* self) { delete static_cast<ExportContext*>(self->manager_ctx); };
  m.flags = 0;
  m.dl_tensor = tensor_of(ctx, v);
  return &m;
}

DLManagedTensor* export_legacy(const std::shared_ptr<Capturer>& owner, const BufferView& v) {
  ExportContext* ctx = make_context(owner, v);
  DLManagedTensor& m = ctx->legacy;
  m.manager_ctx = ctx;
  m.deleter = [](DLManagedTensor* self) { delete static_cast<ExportContext*>(self->manager_ctx); };
  m.dl_tensor = tensor_of(ctx, v);
  return &m;
}

}  // namespace moecap
