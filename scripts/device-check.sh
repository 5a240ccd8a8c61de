#!/usr/bin/env bash
# One command for the GPU machine: configure (CMake + Ninja, Release, sm_90a), build, run the GPU
# tests, optionally under compute-sanitizer, run the named benchmarks, and print a short table last.
#
#   scripts/device-check.sh [--sanitize] [--filter GTEST_FILTER] [--sanitize-filter GTEST_FILTER]
#                           [--all-tests] [--no-tests] [--bench "KIND [OPTIONS]"]...
#
# The device tool's call must carry .deps (GoogleTest sources; see README, Development). Logs and
# benchmark outputs go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."

sanitize=0 filter="*" sanitize_filter="" all_tests=0 run_tests=1
benches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --filter) filter="$2"; shift ;;
    --sanitize-filter) sanitize_filter="$2"; shift ;;
    --all-tests) all_tests=1 ;;
    --no-tests) run_tests=0 ;;
    --bench) benches+=("$2"); shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "device-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

out=${OUT:-$PWD/out}
mkdir -p "$out"
summary=()
row() { summary+=("$(printf '%-28s %-8s %s' "$1" "$2" "$3")"); }

# cuDNN (the benchmark's peers) lives in PyTorch's environment on the GPU machine.
if cudnn=$(python3 -c "import nvidia.cudnn,os;print(list(nvidia.cudnn.__path__)[0])" 2>/dev/null); then
  export LD_LIBRARY_PATH="$cudnn/lib:${LD_LIBRARY_PATH:-}"
  export FLAMIA_CUDNN_ROOT="$cudnn"
fi

gpu=$(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader 2>&1 | head -1)
row "gpu" "info" "$gpu"

t0=$(date +%s)
if ! cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  row "configure" "FAIL" "see configure.log"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
if ! cmake --build build-device -j "$(nproc)" >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -40
  row "build" "FAIL" "see build.log"
  printf '%s\n' "${summary[@]}"
  exit 1
fi
row "build" "ok" "$(( $(date +%s) - t0 )) s; spills: $(grep -c 'bytes spill' "$out/build.log" || true) lines"

status=0
gpu_tests=build-device/tests/gpu/flamia_gpu_tests
if [ "$run_tests" = 1 ]; then
  if "$gpu_tests" --gtest_filter="$filter" >"$out/gpu-tests.log" 2>&1; then
    row "gpu tests" "ok" "$(grep -E '^\[  PASSED  \]' "$out/gpu-tests.log")"
  else
    status=1
    grep -E "Failure|FAILED|error" "$out/gpu-tests.log" | head -40
    row "gpu tests" "FAIL" "$(grep -E '^\[  FAILED  \]' "$out/gpu-tests.log" | head -1)"
  fi
  if [ "$all_tests" = 1 ]; then
    # The test binary itself: this machine's newer CMake cannot read gtest_discover_tests' script
    # for the GPU suite, which would stop ctest before any test.
    if build-device/tests/flamia_tests >"$out/cpu-tests.log" 2>&1; then
      row "cpu tests" "ok" "$(grep -E '^\[  PASSED  \]' "$out/cpu-tests.log")"
    else
      status=1
      row "cpu tests" "FAIL" "$(grep -E '^\[  FAILED  \]' "$out/cpu-tests.log" | head -1)"
    fi
  fi
fi
if [ "$sanitize" = 1 ]; then
  if compute-sanitizer --tool memcheck --error-exitcode 1 "$gpu_tests" \
      --gtest_filter="${sanitize_filter:-$filter}" \
      >"$out/sanitizer.log" 2>&1; then
    row "compute-sanitizer" "ok" "$(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -1)"
  else
    status=1
    grep -E "=========" "$out/sanitizer.log" | head -30
    row "compute-sanitizer" "FAIL" "$(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -1)"
  fi
fi

i=0
for b in "${benches[@]}"; do
  i=$((i + 1))
  log="$out/bench-$i.txt"
  # shellcheck disable=SC2086
  if ./build-device/flamia bench $b >"$log" 2>&1; then
    row "bench $b" "ok" "see bench-$i.txt"
  else
    status=1
    row "bench $b" "FAIL" "see bench-$i.txt"
  fi
  echo "== flamia bench $b"
  cat "$log"
done

echo
echo "== device-check summary"
printf '%s\n' "${summary[@]}"
exit $status
