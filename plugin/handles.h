/* SPDX-License-Identifier: Apache-2.0 */
// What the opaque C handles are. A magic word lets debug builds detect use
// after destroy (the shell of a destroyed handle is kept, marked dead).
#pragma once

#include <cstdint>
#include <memory>

#include "moecap.h"
#include "plugin/backend.h"
#include "plugin/capturer.h"

struct moecap_capturer {
  static constexpr uint64_t kLive = 0x6d6f656361702121ull;  // "moecap!!"
  static constexpr uint64_t kDead = 0xdeaddeaddeaddeadull;
  uint64_t magic = kLive;
  std::shared_ptr<moecap::Capturer> impl;
};

struct moecap_graph {
  static constexpr uint64_t kLive = 0x6d6f656761706821ull;
  static constexpr uint64_t kDead = 0xdeaddeaddeaddeadull;
  uint64_t magic = kLive;
  std::shared_ptr<moecap::Capturer> owner;  // graphs replay into the capturer's memory
  std::unique_ptr<moecap::BackendGraph> graph;
};

namespace moecap {

// Zero-copy DLPack views; each holds a reference to the capturer.
DLManagedTensorVersioned* export_versioned(const std::shared_ptr<Capturer>& owner, const BufferView& view);
DLManagedTensor* export_legacy(const std::shared_ptr<Capturer>& owner, const BufferView& view);

}  // namespace moecap
