// Consumption that holds at dp >= 2 on the host backend (tests/support/step_rows.h),
// eagerly and with the side stream's deferred work.
#include <doctest/doctest.h>

#include <deque>
#include <memory>

#include "tests/support/capturer_handle.h"
#include "tests/support/step_rows.h"

namespace {

void run_on_host(int32_t dp, uint32_t flags) {
  moecap_config c = moecap_step_rows::config(dp, MOECAP_DEVICE_HOST);
  c.flags |= flags;
  moecap_test::Handle cap(c);
  std::deque<std::unique_ptr<moecap_test::HostTensor>> held;
  moecap_step_rows::Memory m;
  m.ids = [&held](const std::vector<int32_t>& v, int64_t n, int32_t top_k) {
    held.push_back(std::make_unique<moecap_test::HostTensor>(std::initializer_list<int64_t>{n, top_k}, moecap_test::i32()));
    for (size_t i = 0; i < v.size(); ++i) held.back()->set(static_cast<int64_t>(i), v[i]);
    return held.back()->get();
  };
  moecap_step_rows::run(cap.h, c, m);
}

}  // namespace

TEST_CASE("a step's rows are unusable after its commits at dp 2 and 4, skipped layers read -1 (host)") {
  for (int32_t dp : {2, 4}) {
    CAPTURE(dp);
    run_on_host(dp, 0);
    run_on_host(dp, MOECAP_FLAG_SIDE_STREAM);
  }
}
