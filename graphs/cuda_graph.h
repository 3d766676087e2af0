/* SPDX-License-Identifier: Apache-2.0 */
// CUDA graphs through the driver: moecap_graph_begin starts a stream capture,
// moecap_graph_end instantiates what was captured, and the BackendGraph it
// returns replays it in the capturer's context. The caller makes the context
// current around begin and end.
#pragma once

#include <memory>

#include "base/cuda_driver.h"
#include "graphs/backend_graph.h"

namespace moecap::cuda {

// Records every operation enqueued on `stream`, from any thread, until end_graph.
void begin_graph(const Driver& d, CUstream stream);
// Ends the capture on `stream` and instantiates it; launches run in `ctx`.
std::unique_ptr<BackendGraph> end_graph(const Driver& d, CUcontext ctx, CUstream stream);

}  // namespace moecap::cuda
