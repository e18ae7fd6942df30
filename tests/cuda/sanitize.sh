#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel the library launches: memcheck, racecheck, initcheck and
# synccheck, each over the suite's CUDA tests that cover every op, dtype and edge shape at small
# sizes (length 1, odd lengths, partial tiles, every split path, zero sizes, misaligned inputs).
# For a GPU machine with the .bundle/ of scripts/gpu-bundle.sh:
#   bash tests/cuda/sanitize.sh [tool...]        default: all four
#   XLA_SSM_SANITIZE_TESTS="mod::test ..."       a subset of the tests below (racecheck is slow)
# Logs go to $OUT/sanitize (the device tool's folder) or /tmp/sanitize. Exit status 0 only if every
# tool ran to the end and reported 0 errors.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck synccheck)
log="${OUT:-/tmp}/sanitize"
mkdir -p "$log"
suite="$(mktemp)"
gzip -dc .bundle/suite.gz >"$suite" && chmod +x "$suite"

tests=(
  ffi_cuda::roundtrip_matrix ffi_cuda::zero_sizes ffi_cuda::misaligned_bc ffi_cuda::split_sequence
  ffi_cuda::tiny_dt_f32 ffi_cuda::c_api_cuda_launch
  ffi_cuda_bwd::roundtrip_matrix ffi_cuda_bwd::zero_sizes ffi_cuda_bwd::misaligned_checkpoints
  ffi_cuda_ssd::shapes_groups_chunks ffi_cuda_ssd::dtypes ffi_cuda_ssd::tensor_core_paths
  ffi_cuda_ssd::every_combination_of_optional_operands ffi_cuda_ssd::zero_sized_dims
  ffi_cuda_ssd::misaligned_workspace
  ffi_cuda_decode::state_update_matches_reference ffi_cuda_decode::conv1d_fwd_bwd_update_match_reference
  ffi_cuda_decode::decode_step_matches_reference ffi_cuda_decode::state_update_pool_indices_and_out_of_range_skipped
  ffi_cuda_decode::zero_sizes
  packed::cuda_matches_host ffi_cuda_ssd::packed_matches_host conv1d_packed::cuda_matches_cpu
  ffi_cuda_ssd::packed_invalid_boundaries_stay_in_bounds
)
if [ -n "${XLA_SSM_SANITIZE_TESTS:-}" ]; then
  read -r -a tests <<<"$XLA_SSM_SANITIZE_TESTS"
fi

status=0
for tool in "${tools[@]}"; do
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report all)
  echo "== compute-sanitizer --tool $tool (${#tests[@]} tests)"
  start=$SECONDS
  compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 20 \
    "$suite" --ignored --exact --test-threads=1 "${tests[@]}" >"$log/$tool.log" 2>&1
  rc=$?
  summary="$(grep -E '^========= (ERROR SUMMARY|RACECHECK SUMMARY)' "$log/$tool.log" | tail -n 1)"
  result="$(grep -E '^test result' "$log/$tool.log" | tail -n 1)"
  echo "   rc $rc in $((SECONDS - start)) s; ${summary:-no summary}; ${result:-no test result}"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E '^=========' "$log/$tool.log" | head -n 30
    grep -E 'FAILED|panicked' "$log/$tool.log" | head -n 10
  fi
done
rm -f "$suite"
exit $status
