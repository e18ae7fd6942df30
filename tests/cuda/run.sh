#!/usr/bin/env bash
# The CUDA kernel tests: standalone programs that include the product kernels (kernels/*.cu), run
# them on the GPU without XLA or Rust, and compare every result with a double-precision (decode: f32)
# reference on the host. For a GPU machine with nvcc (NVCC, else nvcc on PATH).
#   bash tests/cuda/run.sh [check|time|all]
# check (the default): every correctness matrix; exits 1 if any build or case fails.
# time: CUDA-event timings of the benchmark shapes (kernel level; BENCHMARKS.md, "Method").
# build: the binaries only (build while the GPU does something else, then run with
#   TESTS_CUDA_REUSE=1, which keeps binaries already built).
# Binaries and logs go to $OUT/tests_cuda (the device tool's folder) or /tmp/tests_cuda.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mode="${1:-check}"
case "$mode" in check | time | all | build) ;; *) echo "usage: $0 [check|time|all|build]" >&2; exit 2 ;; esac
nvcc="${NVCC:-nvcc}"
bin="${OUT:-/tmp}/tests_cuda"
mkdir -p "$bin"

# The GPU's architecture: sm_90 is built as sm_90a, as build.rs does (wgmma); the SSD harnesses are
# then also built for plain sm_90, the mma.sync kernels other GPUs run.
cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')"
cap="${CUDA_ARCH:-${cap:-90}}"
arch="$cap"
[ "$cap" = 90 ] && arch=90a
nvidia-smi -L 2>/dev/null
echo "nvcc: $("$nvcc" --version | tail -n 1); building for sm_$arch"

# name source arch [flags...]
builds=()
build() {
  local name=$1 src=$2 a=$3
  shift 3
  builds+=("$name")
  [ -n "${TESTS_CUDA_REUSE:-}" ] && [ -x "$bin/$name" ] && return
  "$nvcc" -O3 -std=c++17 -gencode=arch=compute_$a,code=sm_$a "$@" -o "$bin/$name" "tests/cuda/$src" >"$bin/$name.build.log" 2>&1 &
}
build fwd_check fwd_check.cu "$arch"
build bwd_check bwd_check.cu "$arch"
build state_update_check state_update_check.cu "$arch"
if [ "$arch" = 90a ]; then
  build ssd_fwd_check ssd_fwd_check.cu 90a -DSSD_WGMMA=1
  build ssd_bwd_check ssd_bwd_check.cu 90a
  build ssd_fwd_check_sync ssd_fwd_check.cu 90 -DSSD_WGMMA=0
  build ssd_bwd_check_sync ssd_bwd_check.cu 90
else
  build ssd_fwd_check ssd_fwd_check.cu "$arch" -DSSD_WGMMA=0
  build ssd_bwd_check ssd_bwd_check.cu "$arch"
fi
wait
failed=()
for b in "${builds[@]}"; do
  if [ ! -x "$bin/$b" ]; then
    echo "BUILD FAILED: $b"
    tail -n 20 "$bin/$b.build.log"
    failed+=("build $b")
  fi
done

[ "$mode" = build ] && { echo "built: ${builds[*]}; ${#failed[@]} failed"; [ ${#failed[@]} -eq 0 ]; exit; }
cases=0
run() {  # run BINARY ARGS...: one case; a failure is counted, not fatal
  local exe=$1
  shift
  cases=$((cases + 1))
  echo "== $exe $*"
  if [ ! -x "$bin/$exe" ]; then failed+=("$exe $* (not built)"); return; fi
  "$bin/$exe" "$@" || failed+=("$exe $*")
}
section() { echo; echo "######## $*"; }

if [ "$mode" != time ]; then
  section "fwd_check: the selective scan forward (kernels/selective_scan_fwd.cuh), tiled and lanes kernels:" \
    "output, final state and checkpoints against a double-precision recurrence (bf16, z, D, delta_bias, softplus)"
  #               batch dim seqlen dstate layout tpc chunks checkpoint_len h0
  run fwd_check check 2 64 256 16 bdl 0 0 0 0        # the launcher's split (4 chunks)
  run fwd_check check 2 64 256 16 bdl 1 1 0 1        # one thread a channel, unsplit, initial state
  run fwd_check check 2 64 256 16 bdl 2 1 64 1       # two threads a channel, checkpoints
  run fwd_check check 2 136 1000 16 bdl 1 0 32 1     # partial last tile and channel tile, split, one thread a channel
  run fwd_check check 3 200 520 13 bld 0 0 64 1      # channel-last, odd dstate (B/C element by element)
  run fwd_check check 2 136 304 13 bld 1 3 32 0      # channel-last at one thread a channel, 3 chunks
  run fwd_check check 1 40 64 16 bdl 0 0 0 1         # too short to split
  run fwd_check check 1 96 1000 32 bld 0 0 32 1      # 4 threads a channel
  run fwd_check check 2 128 160 64 bdl 0 0 32 1      # 8 threads a channel (swizzled B/C rows)
  run fwd_check check 1 64 96 128 bld 0 0 32 1       # 16 threads a channel, channel-last B/C as vectors
  run fwd_check check 1 40 1000 200 bdl 0 0 0 1      # 32 threads a channel, partial states
  run fwd_check check 1 32 520 256 bld 0 2 64 1      # 32 threads a channel, channel-last, 2 chunks
  run fwd_check check 8 3712 64 16 bld 0 0 32 1      # a grid large enough for one thread a channel (auto)
  run fwd_check check 1 4096 3072 16 bdl 0 0 32 1    # split into 384-step chunks: first pass at 2 threads, second at 1
  # packed sequences (last argument: how many; batch 1): empty and length-1 sequences, boundaries on
  # chunk and checkpoint edges, off tile edges and at seqlen, against each sequence scanned alone
  #               batch dim seqlen dstate layout tpc chunks checkpoint_len h0 seqs
  run fwd_check check 1 64 1000 16 bdl 0 0 0 1 9       # the launcher's split (11 chunks of 96)
  run fwd_check check 1 64 1000 16 bdl 0 0 32 0 40     # split, checkpoints, many short sequences, no initial state
  run fwd_check check 1 64 1000 16 bdl 0 1 64 1 40     # unsplit, checkpoints
  run fwd_check check 1 136 520 13 bld 0 3 64 1 12     # channel-last, odd dstate, partial channel tile, 3 chunks
  run fwd_check check 1 96 1000 32 bld 0 0 32 1 7      # 4 threads a channel, split
  run fwd_check check 1 128 160 64 bdl 0 1 32 1 6      # 8 threads a channel
  run fwd_check check 1 64 96 128 bld 0 2 32 1 5       # 16 threads a channel, B/C as vectors, 2 chunks
  run fwd_check check 1 40 1000 200 bdl 0 0 32 1 17    # 32 threads a channel, partial states, split
  run fwd_check check 1 64 256 16 bdl 2 4 32 1 1       # one sequence: as unpacked
  run fwd_check check 1 64 0 16 bdl 0 0 0 1 3          # seqlen 0: every sequence empty
  run fwd_check check 1 4096 3072 16 bdl 0 0 32 1 50   # split into 384-step chunks (two threads a channel)
  run fwd_check check 1 64 1000 16 bdl 0 0 32 1 -9     # invalid boundaries: no fault (also under compute-sanitizer)
  run fwd_check check 1 64 200 64 bld 0 2 0 1 -30

  section "bwd_check: the selective scan backward (kernels/selective_scan_bwd.cuh), kernel and both reductions:" \
    "every gradient against a double-precision reverse recurrence"
  #               batch dim seqlen dstate groups layout dtype ckl z D bias sp h0 dfin
  run bwd_check check 2 64 64 16 1 bdl f32 32 1 1 1 1 1 1
  run bwd_check check 2 130 77 16 1 bdl f32 32 1 1 1 1 1 1
  run bwd_check check 2 130 77 16 1 bld f32 64 1 1 1 1 1 1
  run bwd_check check 1 96 200 16 4 bdl f32 96 0 1 0 1 0 1
  run bwd_check check 3 96 45 5 2 bld f32 32 1 0 1 0 1 0
  run bwd_check check 2 70 100 16 0 bdl f32 64 1 1 1 1 1 1
  run bwd_check check 2 70 100 13 0 bld f32 32 0 0 0 1 1 1
  run bwd_check check 1 40 90 32 1 bdl f32 32 1 1 1 1 1 1
  run bwd_check check 1 24 70 64 2 bld f32 64 1 1 1 1 1 1
  run bwd_check check 1 20 50 200 1 bdl f32 32 1 1 1 1 1 1
  run bwd_check check 1 9 40 256 0 bdl f32 32 1 1 1 1 1 1
  run bwd_check check 2 256 300 16 1 bdl bf16 64 1 1 1 1 1 1
  run bwd_check check 2 256 300 16 2 bld bf16 32 1 1 1 1 1 1
  run bwd_check check 1 64 20 16 1 bdl f32 32 1 1 1 1 1 1
  # 16-byte vector staging (seqlen, or the group's channels, a multiple of a vector), partial tiles
  run bwd_check check 2 200 296 16 1 bdl bf16 32 1 1 1 1 1 1
  run bwd_check check 2 272 104 16 2 bld bf16 32 1 1 1 1 1 1
  run bwd_check check 1 96 40 12 1 bld f32 32 1 1 1 1 1 1
  run bwd_check check 1 64 72 13 1 bdl bf16 64 1 1 1 1 1 1
  run bwd_check check 1 64 0 16 1 bdl f32 32 1 1 1 1 1 1
  # the next tile copied ahead (2-byte inputs): a partial last tile behind a forward pass, a split sequence
  run bwd_check check 2 256 304 16 1 bdl bf16 64 1 1 1 1 1 1
  run bwd_check check 1 128 2000 16 1 bld bf16 32 1 1 1 1 1 1
  run bwd_check check 1 128 520 16 0 bdl bf16 32 1 1 1 1 1 1
  # dstate 64 and 128 with 2-byte B/C staged in vectors (their swizzled shared rows)
  run bwd_check check 2 128 160 64 1 bdl bf16 32 1 1 1 1 1 1
  run bwd_check check 1 64 96 128 2 bld bf16 32 1 1 1 1 1 1
  # packed sequences (the _packed kernels, batch 1; last argument: sequences), against each sequence's
  # backward alone: boundaries on and off part, checkpoint, tile and piece edges, empty and length-1
  # sequences, at seqlen; NaN checkpoints at boundaries, NaN-filled dinitial_state rows
  #               batch dim seqlen dstate groups layout dtype ckl z D bias sp h0 dfin seqs
  run bwd_check check 1 64 300 16 1 bdl f32 32 1 1 1 1 1 1 12             # split: 10 parts of one chunk
  SSB_PARTS=1 run bwd_check check 1 64 300 16 1 bdl f32 32 1 1 1 1 1 1 12 # unsplit
  SSB_PARTS=3 run bwd_check check 1 64 500 16 1 bld f32 64 1 1 1 1 1 1 20 # 3 parts of 3 two-tile chunks
  run bwd_check check 1 130 333 16 1 bdl bf16 96 1 1 1 1 1 1 30           # three-tile chunks, a partial channel tile
  run bwd_check check 1 96 200 16 0 bdl f32 64 1 0 1 0 1 0 9              # time-invariant B/C, no dfinal_state
  run bwd_check check 1 96 200 16 4 bld bf16 32 0 1 0 1 0 1 9             # groups, no initial state
  run bwd_check check 1 40 150 64 2 bdl f32 32 1 1 1 1 1 1 200            # more sequences than steps (8 threads a channel)
  run bwd_check check 1 20 90 200 1 bld f32 32 1 1 1 1 1 1 15             # 32 threads a channel, partial states
  run bwd_check check 1 64 2000 16 1 bdl bf16 32 1 1 1 1 1 1 3            # long sequences, tiles copied ahead
  run bwd_check check 1 64 0 16 1 bdl f32 32 1 1 1 1 1 1 3                # seqlen 0: every sequence empty
  run bwd_check check 1 64 300 16 1 bdl f32 32 1 1 1 1 1 1 -40            # invalid boundaries: stays in bounds (sanitizer)

  for v in ssd_fwd_check ssd_fwd_check_sync; do
    [[ " ${builds[*]} " == *" $v "* ]] || continue
    section "$v: the SSD forward (kernels/ssd_fwd.cu$([ $v = ssd_fwd_check_sync ] && echo ', the mma.sync kernels')):" \
      "y, final and chunk states against a double-precision recurrence"
    #             batch seqlen heads groups dstate dtype chunk D z bias sp h0 clamp parts
    run $v check 1 64 1 1 64 bf16 64 0 0 0 0 0 0 1
    run $v check 2 200 4 2 128 bf16 64 1 1 1 1 1 0 1
    run $v check 2 200 4 2 128 f16 128 2 1 1 1 1 1 1
    run $v check 1 333 3 1 64 bf16 256 1 0 1 1 0 1 1
    run $v check 1 333 3 3 64 f16 64 2 1 0 0 1 0 3
    run $v check 2 1000 2 1 128 bf16 256 1 1 1 1 1 0 4
    run $v check 1 130 2 1 128 bf16 64 0 0 0 1 1 0 7
    run $v check 3 100 3 1 128 bf16 64 1 1 1 1 1 0 2
    run $v check 1 5 2 1 64 f16 64 1 1 1 1 1 0 0
    run $v check 1 0 2 1 64 bf16 64 1 1 1 1 1 0 0
    # the launcher's split (parts 0): 9 parts, the first pass in 2 pieces a part (plan::mma_fwd_split)
    run $v check 2 1087 8 2 128 bf16 64 1 1 1 1 1 0 0
    run $v check 1 1087 16 4 64 f16 128 2 0 1 1 0 1 0
    # more pieces a part than the launcher's rule gives here
    SSD_FWD_RECORDS=3 run $v check 2 1000 2 1 128 bf16 64 1 1 1 1 1 0 4
    SSD_FWD_RECORDS=4 run $v check 1 1100 3 1 64 f16 64 1 0 1 1 1 0 3
    # every tile's scalars formed by the wgmma kernel itself (where the launcher parks none in y)
    SSD_FORM_SCALARS=1 run $v check 2 1087 8 2 128 bf16 64 1 1 1 1 1 0 0
    SSD_FORM_SCALARS=1 run $v check 2 1000 2 1 128 bf16 64 1 1 1 1 1 0 4
    # the inference forward (no chunk states) over several chunks, split and not
    SSD_NO_CHUNK_STATES=1 run $v check 2 1000 2 1 128 bf16 64 1 1 1 1 1 0 4
    SSD_NO_CHUNK_STATES=1 run $v check 1 1087 16 4 64 f16 128 2 0 1 1 0 1 0
  done

  for v in ssd_bwd_check ssd_bwd_check_sync; do
    [[ " ${builds[*]} " == *" $v "* ]] || continue
    for partials in 0 1; do  # both ways to dB, dC (the library picks per shape: plan::mma_bwd_head_sums)
      export SSD_BWD_PARTIALS=$partials
      section "$v: the SSD backward (kernels/ssd_bwd.cu$([ $v = ssd_bwd_check_sync ] && echo ', the mma.sync first pass'))," \
        "dB and dC through the $([ $partials = 1 ] && echo per-head partials || echo head sums):" \
        "every gradient against a double-precision reverse recurrence, and a rerun bitwise equal"
      #             batch seqlen heads groups dstate dtype chunk D bias sp h0 dfin clamp
      run $v check 1 64 1 1 64 bf16 64 0 0 0 0 0 0
      run $v check 1 64 1 1 64 f16 64 1 1 1 1 1 0
      run $v check 2 200 4 2 128 f16 128 2 1 1 1 1 1
      run $v check 1 333 3 1 64 bf16 256 1 1 1 0 1 1
      run $v check 2 300 4 4 128 bf16 64 2 0 1 1 0 0
      run $v check 1 5 2 1 64 f16 64 1 1 1 1 1 0
      SSD_BWD_PARTS=3 run $v check 1 700 2 1 128 bf16 128 2 1 1 1 1 1
      SSD_BWD_PARTS=2 run $v check 2 200 2 2 64 f16 64 1 1 1 1 1 0
      # chunk 256 at dstate 128: a tile's entering state kept in registers, shared memory and scratch
      SSD_BWD_PARTS=2 run $v check 2 700 3 1 128 bf16 256 1 1 1 1 1 0
      run $v check 1 1000 2 1 128 f16 256 2 1 1 0 1 1
    done
    unset SSD_BWD_PARTIALS
  done

  section "state_update_check: the decode kernels (kernels/selective_state_update.cu), state update and fused" \
    "decode step: state, output and conv state against a host reference (each also timed)"
  #                      batch dim dstate [groups pool]
  run state_update_check 256 5120 16
  run state_update_check 1 4096 16
  run state_update_check 8 4096 16
  run state_update_check 64 5120 16
  run state_update_check 37 200 16 4 1   # groups, a pool of states with padding entries
  run state_update_check 300000 1 16     # a batch past the grid's 65535 rows
fi

if [ "$mode" != check ]; then
  section "timings (us): the issue's shapes, bf16"
  run fwd_check time 8 4096 2048 16 bdl
  run fwd_check time 8 4096 2048 16 bld
  run fwd_check time 8 4096 2048 16 bdl 0 0 32   # the training forward (checkpoints every 32 steps)
  run fwd_check time 16 5120 2048 16 bdl
  run fwd_check time 1 4096 16384 16 bdl
  run fwd_check time 1 1536 2048 16 bdl
  run fwd_check time 1 4096 16384 16 bld                  # packed, below: against this
  run fwd_check time 1 4096 16384 16 bld 0 0 0 0 8        # the same tokens packed in 8 sequences
  run fwd_check time 8 4096 2048 64 bdl
  run bwd_check time 8 4096 2048 16 1 bdl bf16 32 1 1 1 1 0 0
  run bwd_check time 8 4096 2048 16 1 bdl bf16 64 1 1 1 1 0 0
  run bwd_check time 8 4096 2048 16 1 bld bf16 64 1 1 1 1 0 0
  run bwd_check time 1 1536 2048 16 1 bdl bf16 32 1 1 1 1 0 0
  run bwd_check time 1 1536 2048 16 1 bdl bf16 32 1 1 1 1 0 0 16   # the same packed in 16 sequences
  run bwd_check time 8 4096 2048 16 0 bdl bf16 64 1 1 1 1 0 0
  run bwd_check time 8 4096 2048 64 1 bdl bf16 32 1 1 1 1 0 0
  run ssd_fwd_check time 8 2048 64 1 128 bf16 256 1 0 1 1 0 0 0
  run ssd_fwd_check time 1 16384 64 1 128 bf16 256 1 0 1 1 0 0 0
  run ssd_fwd_check time 8 2048 64 8 128 bf16 256 1 1 1 1 0 0 0
  run ssd_fwd_check time 8 2048 64 1 64 f16 256 1 0 1 1 0 0 0
  run ssd_bwd_check time 8 2048 64 1 128 bf16 256 1 1 1 0 0 0
  run ssd_bwd_check time 1 16384 64 1 128 bf16 256 1 1 1 0 0 0
  SSD_BWD_PARTIALS=1 run ssd_bwd_check time 8 2048 64 8 128 bf16 256 1 1 1 0 0 0
  [ "$mode" = time ] && run state_update_check 256 5120 16
fi

echo
echo "######## $cases cases, ${#failed[@]} failed"
for f in "${failed[@]}"; do echo "FAILED: $f"; done
[ ${#failed[@]} -eq 0 ]
