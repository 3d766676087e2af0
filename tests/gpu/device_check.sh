#!/usr/bin/env bash
# Everything GPU-side in one go, on a machine with a GPU and nvcc: configure
# with CUDA, build, run the GPU tests (ctest -L gpu: the CUDA backend against
# the host backend, and the PyTorch torch.cuda.graph test), the rest of the
# suite, and moecap_bench. Logs and the benchmark JSON go to $OUT when set.
# Debian packages unpacked by tests/gpu/prepare_deps.sh into .deps/ are used
# where the machine lacks them.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$root/build-gpu/out}
build=$root/build-gpu
mkdir -p "$out"
exec > >(tee "$out/device_check.log") 2>&1

args=(-DCMAKE_BUILD_TYPE=Release -DMOECAP_CUDA=ON -DMOECAP_PYTHON="${MOECAP_PYTHON:-$(command -v python3)}")
if [ -d "$root/.deps/usr" ]; then
  args+=(-DCMAKE_PREFIX_PATH="$root/.deps/usr" -DDOCTEST_INCLUDE_DIR="$root/.deps/usr/include"
         -DDLPACK_INCLUDE_DIR="$root/.deps/usr/include")
  export LD_LIBRARY_PATH="$root/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
step() { echo; echo "=== $1"; shift; "$@" || { echo "=== FAILED: $*"; status=1; }; }
step configure cmake -S "$root" -B "$build" "${args[@]}"
step build cmake --build "$build" -j "$(nproc)"
step "gpu tests" ctest --test-dir "$build" -L gpu --output-on-failure
step "other tests" ctest --test-dir "$build" -LE gpu --output-on-failure
# The GPU suites again under compute-sanitizer: any access to freed or foreign
# memory by moecap's kernels (a graph replayed after moecap_destroy, a gather
# into a GPU tensor) fails the step.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$sanitizer" ]; then
  memcheck() { "$sanitizer" --tool memcheck --error-exitcode 1 --leak-check no "$@"; }
  step "memcheck gpu_backend" memcheck "$build/tests/gpu/moecap_gpu_tests"
  step "memcheck gpu_scenarios" memcheck "$build/tests/gpu/moecap_gpu_scenarios"
  step "memcheck gpu_topk_views" memcheck "$build/tests/gpu/moecap_gpu_topk_views"
  if [ -x "$build/examples/engine_sim" ]; then
    step "memcheck engine_sim" memcheck "$build/examples/engine_sim" --backend cuda --requests 2000
    step "memcheck engine_sim --side-stream" memcheck "$build/examples/engine_sim" --backend cuda --requests 2000 \
      --side-stream
  fi
  if [ -n "${MOECAP_PYTHON:-$(command -v python3)}" ]; then
    step "memcheck torch" env MOECAP_LIBRARY="$build/libmoecap.so" PYTHONDONTWRITEBYTECODE=1 \
      "$sanitizer" --tool memcheck --error-exitcode 1 --leak-check no --target-processes all \
      "${MOECAP_PYTHON:-python3}" "$root/tests/gpu/run_gpu_pytest.py" "$root/tests/python"
  fi
else
  echo "=== compute-sanitizer not found: memcheck steps not run"; status=1
fi
if [ -x "$build/bench/moecap_bench" ]; then
  step bench "$build/bench/moecap_bench" --benchmark_min_time=0.05 \
    --benchmark_out="$out/moecap_bench.json" --benchmark_out_format=json
  step "bench report" python3 "$root/bench/report.py" "$out/moecap_bench.json"
fi
echo "device_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
