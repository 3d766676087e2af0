// SPDX-License-Identifier: Apache-2.0
// On the CUDA backend over the stand-in driver: consumption that holds at
// dp >= 2 (tests/support/step_rows.h), and the claim path's bookkeeping when
// the slot tensor changes between the kernels of one commit.
#include <doctest/doctest.h>

#include <cstdlib>
#include <deque>
#include <string>

#include "graphs/element.h"
#include "graphs/kernel_params.h"
#include "tests/cuda_standin/engine.h"
#include "tests/support/step_rows.h"

using namespace standin;

namespace {

struct Setup {
  Setup() { setenv("MOECAP_LIBCUDA", MOECAP_STANDIN_DRIVER, 1); }
};
const Setup setup;

}  // namespace

TEST_CASE("a step's rows are unusable after its commits at dp 2 and 4, skipped layers read -1 (CUDA backend)") {
  for (int32_t dp : {2, 4}) {
    CAPTURE(dp);
    const moecap_config c = moecap_step_rows::config(dp, MOECAP_DEVICE_CUDA);
    moecap_capturer* h = nullptr;
    REQUIRE_MESSAGE(moecap_create(&c, &h) == MOECAP_OK, std::string(moecap_last_error()));
    std::deque<Tensor> held;
    moecap_step_rows::Memory m;
    m.stream = new_stream();
    m.ids = [&held](const std::vector<int32_t>& v, int64_t n, int32_t top_k) {
      held.emplace_back(std::vector<int64_t>{n, top_k}, moecap_test::i32(), kDLCUDA);
      if (!v.empty()) std::memcpy(held.back().as<int32_t>(), v.data(), v.size() * sizeof(int32_t));
      return held.back().get();
    };
    moecap_step_rows::run(h, c, m);
    CHECK(moecap_destroy(h) == MOECAP_OK);
  }
}

// The claim, commit and release kernels launched by hand, so that the slot
// tensor can change between them, as a late join or an engine's next upload
// overlapping a forked commit changes it on a GPU.
TEST_CASE("a slot tensor that changes between the claim and release kernels leaves no claim behind") {
  using namespace moecap;
  auto load = entry<int (*)(void**, const void*)>("cuModuleLoadData");
  auto unload = entry<int (*)(void*)>("cuModuleUnload");
  auto function = entry<int (*)(const void**, void*, const char*)>("cuModuleGetFunction");
  auto launch = entry<int (*)(const void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              void*, void**, void**)>("cuLaunchKernel");
  void* module = nullptr;
  static const char image[] = "kernels";
  REQUIRE(load(&module, image) == 0);
  const void* claim = nullptr;
  const void* commit = nullptr;
  const void* release = nullptr;
  REQUIRE(function(&claim, module, "moecap_claim_kernel") == 0);
  REQUIRE(function(&commit, module, "moecap_commit_kernel") == 0);
  REQUIRE(function(&release, module, "moecap_release_kernel") == 0);

  constexpr int64_t kDeviceRows = 4, kHostSlots = 8;
  Tensor src({kDeviceRows}, moecap_test::i16(), kDLCUDA);  // one layer, top-1
  for (int64_t r = 0; r < kDeviceRows; ++r) src.as<int16_t>()[r] = static_cast<int16_t>(r + 1);
  Tensor dst({kHostSlots}, moecap_test::u8(), kDLCUDAHost);
  Tensor states({kHostSlots}, moecap_test::u8(), kDLCUDAHost);
  Tensor errors({2}, moecap_test::i64(), kDLCUDA);
  Tensor step({4}, moecap_test::i64(), kDLCUDA);  // StepWord, then one LayerStamp (never captured)
  Tensor claims({kHostSlots}, moecap_test::i64(), kDLCUDA);
  Tensor slots = index_tensor({1, 2, 5}, kDLCUDA);
  Stream s = new_stream();

  CommitParams p{};
  p.src_ids = src.as<uint8_t>();
  p.dst_ids = dst.as<uint8_t>();
  p.dst_states = states.as<uint8_t>();
  p.dst_slots = slots.as<int64_t>();
  p.errors = errors.as<ErrorWord>();
  p.step = step.as<StepWord>();
  p.stamps = reinterpret_cast<const LayerStamp*>(step.as<uint8_t>() + sizeof(StepWord));
  p.claims = claims.as<unsigned long long>();
  p.count = 3;
  p.device_rows = kDeviceRows;
  p.host_slots = kHostSlots;
  p.dst_no_expert = 0xff;
  p.mode = kCommitRows;
  p.num_layers = 1;
  p.top_k = 1;
  p.num_experts = 16;
  p.src_id_elem = kI16;
  p.dst_id_elem = kU8;
  p.weight_elem = -1;
  p.src_rows_elem = kI64;
  p.dst_slots_elem = kI64;
  auto run = [&](const void* fn, CommitParams params) {
    void* args[] = {&params};
    REQUIRE(launch(fn, 1, 1, 1, 256, 1, 1, 0, s, args, nullptr) == 0);
    standin_run_stream(s);
  };
  run(claim, p);                        // entry 2 claims slot 5
  slots.as<int64_t>()[2] = 6;           // the engine's next upload lands meanwhile
  run(commit, p);
  run(release, p);
  CHECK(states.as<uint8_t>()[1] == MOECAP_SLOT_VALID);
  CHECK(states.as<uint8_t>()[5] == MOECAP_SLOT_EMPTY);
  CHECK(states.as<uint8_t>()[6] == MOECAP_SLOT_EMPTY);  // its entry did not hold the slot's claim: nothing written

  // A later commit whose first entry targets slot 5: the claim left there
  // by entry 2 must not outrank it.
  src.as<int16_t>()[0] = 9;
  slots.as<int64_t>()[0] = 5;
  p.count = 1;
  run(claim, p);
  run(commit, p);
  run(release, p);
  CHECK(states.as<uint8_t>()[5] == MOECAP_SLOT_VALID);
  CHECK(dst.as<uint8_t>()[5] == 9);
  CHECK(unload(module) == 0);
}
