#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Everything GPU-side in one go, on a machine with a GPU and nvcc and no
# network: configure with CUDA and the Python package, build, run the GPU
# tests (ctest -L gpu: the CUDA backend against the host backend, the
# stand-in scenarios, engine_sim on CUDA, the PyTorch torch.cuda.graph tests),
# the rest of the suite, the GPU suites again under compute-sanitizer memcheck,
# and moecap_bench with its report. Ends with a table (step, result, seconds).
# Logs and the benchmark JSON go to $OUT when set.
#
# The interpreter is the machine's own python3 (or $MOECAP_PYTHON), with its
# own torch and NumPy; what it may lack comes from .deps/, made here by
# tests/gpu/prepare_deps.sh and carried along: .deps/usr (doctest, DLPack,
# Google Benchmark) and .deps/python (nanobind, pytest), put on PYTHONPATH by
# a wrapper interpreter (ctest's Python tests set PYTHONPATH themselves, to
# build/python, so the wrapper appends to it rather than an export here).
# Not run here: ctest python_wheel (a CPU-only pip wheel build, which needs
# scikit-build-core and pip's --python; the development machine runs it), and
# test_environment.py's check that the interpreter is scripts/venv.sh's
# (torch >= 2.4, NumPy 2, JAX): here it is the machine's own, on purpose;
# tests that need newer torch or NumPy skip.
# Each step has a time limit, and all of them together MOECAP_CHECK_SECONDS
# (570: the table still prints inside a 600-second device command); a step
# left without time is reported as not run. The least certain step (the
# PyTorch tests under memcheck) goes last, with MOECAP_MEMCHECK_TORCH_SECONDS
# (150) kept back for it from every step before.
# A short lease can leave out what the development machine already runs:
# MOECAP_CHECK_CPU_TESTS=0 skips the CPU-only ctest set, and
# MOECAP_BENCH_FILTER (a Google Benchmark regex, e.g. Cuda) narrows the bench.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$root/build-gpu/out}
build=$root/build-gpu
budget=${MOECAP_CHECK_SECONDS:-570}
torch_reserve=${MOECAP_MEMCHECK_TORCH_SECONDS:-150}
mkdir -p "$out" "$build"
# Everything also goes to the log through tee; the caller's stdout stays on
# fd 3 for the final table, printed once tee has written everything before it.
exec 3>&1
exec > >(tee "$out/device_check.log") 2>&1
tee_pid=$!

names=() results=() seconds=()
status=0
reserve=$torch_reserve  # kept back for the last step (memcheck torch) until it runs
# step NAME LIMIT_SECONDS COMMAND...: exit 0 passes, 77 is a skip; a timeout or anything else fails.
step() {
  local name=$1 limit=$2 start=$SECONDS rc result
  shift 2
  (( limit > budget - 10 - reserve - SECONDS )) && limit=$(( budget - 10 - reserve - SECONDS ))  # 10 s for the table
  echo; echo "=== $name"
  if (( limit <= 0 )); then
    result="NOT RUN (out of time)"; status=1
  else
    timeout --kill-after=5 "$limit" "$@"
    rc=$?
    case $rc in
      0) result=passed ;;
      77) result=skipped ;;
      124|137) result="TIMED OUT (${limit}s)"; status=1 ;;
      *) result="FAILED (exit $rc)"; status=1 ;;
    esac
  fi
  echo "=== $name: $result"
  names+=("$name") results+=("$result") seconds+=($(( SECONDS - start )))
}
note() { names+=("$1") results+=("$2") seconds+=(0); echo "=== $1: $2"; }

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH  # the toolkit's usual home; CMake looks for nvcc on PATH
fi
python=$(command -v "${MOECAP_PYTHON:-python3}") || { echo "no ${MOECAP_PYTHON:-python3} on PATH"; exit 1; }
deps_python=$root/.deps/python
args=(-DCMAKE_BUILD_TYPE=Release -DMOECAP_CUDA=ON)
# The extension needs the interpreter's headers: without them CMake skips the
# Python package quietly and the PyTorch GPU tests would not run. Say so up
# front, and build the rest.
python_include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
have_python_h=1
if [ -z "$python_include" ] || [ ! -f "$python_include/Python.h" ]; then
  have_python_h=0
  echo "no Python.h for $python (looked in '${python_include:-?}'): the extension and the PyTorch GPU tests are not built"
  echo "(install the interpreter's development headers, e.g. python3-dev)"
fi
if [ -d "$root/.deps/usr" ]; then
  args+=(-DCMAKE_PREFIX_PATH="$root/.deps/usr" -DDOCTEST_INCLUDE_DIR="$root/.deps/usr/include"
         -DDLPACK_INCLUDE_DIR="$root/.deps/usr/include")
  export LD_LIBRARY_PATH="$root/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ -d "$deps_python" ]; then
  # After the caller's PYTHONPATH (ctest's build/python), before site-packages:
  # .deps' pytest wins over an older one of the machine's; torch and NumPy are not in .deps.
  cat > "$build/python3" <<EOF
#!/bin/sh
# $python with .deps/python (tests/gpu/device_check.sh writes this file)
PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$deps_python" exec "$python" "\$@"
EOF
  chmod +x "$build/python3"
  args+=(-DMOECAP_PYTHON="$build/python3" -Dnanobind_DIR="$deps_python/nanobind/cmake")
  test_pythonpath=$build/python:$deps_python
else
  args+=(-DMOECAP_PYTHON="$python")
  test_pythonpath=$build/python
fi
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the machine's pytest plugins are none of this suite's business
export PYTEST_ADDOPTS="-k 'not test_interpreter_has_what_the_python_tests_need'"  # every pytest run, ctest's too

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
nvcc --version | tail -2 || true
"$python" -c 'import sys, numpy, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
      "GPU", torch.cuda.is_available(), "numpy", numpy.__version__)' || true

if (( ! have_python_h )); then
  args+=(-DMOECAP_PYTHON=)  # the last -D wins: no Python package
  note "python headers" "FAILED (no Python.h: extension and PyTorch GPU tests not built)"; status=1
fi
step configure 300 cmake -S "$root" -B "$build" "${args[@]}"
step build 600 cmake --build "$build" -j "$(nproc)"
# The extension imports, or the Python GPU tests would skip silently.
if (( have_python_h )); then
  step "python import" 60 env PYTHONPATH="$test_pythonpath" "$python" -c \
    'import moecap; print("moecap", moecap.__file__, "ABI", moecap.abi_version())'
fi
step "gpu tests" 600 ctest --test-dir "$build" -L gpu --no-tests=error --output-on-failure
if [ "${MOECAP_CHECK_CPU_TESTS:-1}" = 0 ]; then
  note "other tests" "skipped (MOECAP_CHECK_CPU_TESTS=0)"
else
  step "other tests" 600 ctest --test-dir "$build" -LE gpu -E '^python_wheel$' -j "$(nproc)" --output-on-failure
fi
# The GPU suites again under compute-sanitizer: any access to freed or foreign
# memory by moecap's kernels (a graph replayed after moecap_destroy, a gather
# into a GPU tensor) fails the step.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$sanitizer" ]; then
  memcheck=("$sanitizer" --tool memcheck --error-exitcode 1 --leak-check no)
  export MOECAP_TEST_HOLD_LIMIT_MS=10000  # a held stream ends by itself (tests/gpu/engine_cudart.cpp says why)
  step "memcheck gpu_backend" 300 "${memcheck[@]}" "$build/tests/gpu/moecap_gpu_tests"
  step "memcheck gpu_scenarios" 300 "${memcheck[@]}" "$build/tests/gpu/moecap_gpu_scenarios" --duration=true
  step "memcheck gpu_topk_views" 120 "${memcheck[@]}" "$build/tests/gpu/moecap_gpu_topk_views"
  if [ -x "$build/examples/engine_sim" ]; then
    step "memcheck engine_sim" 300 "${memcheck[@]}" "$build/examples/engine_sim" --backend cuda --requests 2000
    step "memcheck engine_sim --side-stream" 300 "${memcheck[@]}" "$build/examples/engine_sim" --backend cuda \
      --requests 2000 --side-stream
  fi
else
  note memcheck "FAILED (no compute-sanitizer)"; status=1
fi
if [ -x "$build/bench/moecap_bench" ]; then
  step bench 300 "$build/bench/moecap_bench" --benchmark_min_time=0.05 --benchmark_filter="${MOECAP_BENCH_FILTER:-.}" \
    --benchmark_out="$out/moecap_bench.json" --benchmark_out_format=json
  step "bench report" 60 "$python" "$root/bench/report.py" "$out/moecap_bench.json"
else
  note bench "FAILED (no moecap_bench)"; status=1
fi
# bench/python_bench.py is not run: it measures the host backend only (no CUDA mode).
reserve=0
if [ -n "$sanitizer" ] && (( have_python_h )); then
  step "memcheck torch" 600 env PYTHONPATH="$test_pythonpath" PYTHONDONTWRITEBYTECODE=1 \
    "${memcheck[@]}" --target-processes all "$python" "$root/tests/gpu/run_gpu_pytest.py" "$root/tests/python"
fi

# Close the pipe into tee and wait for it, so nothing it still holds lands
# after (or instead of) the table; then the table goes to the caller and the log.
exec 1>&3 2>&3
for _ in $(seq 100); do kill -0 "$tee_pid" 2>/dev/null || break; sleep 0.1; done  # at most 10 s
{
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
  for i in "${!names[@]}"; do echo "| ${names[$i]} | ${results[$i]} | ${seconds[$i]} |"; done
  echo "| total | $([ $status = 0 ] && echo passed || echo FAILED) | $SECONDS |"
  echo "device_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
} | tee -a "$out/device_check.log"
exit $status
