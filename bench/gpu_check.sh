#!/usr/bin/env bash
# One GPU run, under 8 minutes, installing nothing: the kernel tests natively on
# CUDA, the card's copy bandwidth, every kernel timed against its torch
# reference and that bandwidth (the multi-LoRA pair as its own step), then
# the engine's throughput benchmark.
# Prints a short table last; full figures go to $OUT (if set) or bench/results/.
#
#   bash bench/gpu_check.sh            # on the CUDA machine, from anywhere
#
# Each step has its own time limit and a failing step does not stop the next
# one: the exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
RES=${OUT:-bench/results}
mkdir -p "$RES"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# The repo itself on the path instead of `pip install -e .`: the GPU image has
# torch/triton but cannot reach a registry to resolve the other dependencies.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# What bench/gpu_prepare.sh put in .gpu/ (carried: run(..., carry=[".gpu"])): wheels of the
# packages the engine imports that the image lacks, and the test model's config and tokenizer.
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/qw-site .gpu/wheels/*.whl \
    && export PYTHONPATH="/tmp/qw-site:$PYTHONPATH"
fi
MODEL=models/smollm2-135m
[[ -f $MODEL/config.json || ! -f .gpu/smollm2-135m/config.json ]] || MODEL=.gpu/smollm2-135m
export QWORKER_TEST_MODEL=${QWORKER_TEST_MODEL:-$MODEL}
LOG="$RES/gpu_check.log"
: >"$LOG"
status=()
run_step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  status+=("$(printf '%-18s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  return "$rc"
}

run_step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; \
  grep -m1 'model name' /proc/cpuinfo; nproc; grep -o -w -E 'avx512f|avx512_bf16|amx_tile|amx_bf16' /proc/cpuinfo | sort -u | tr '\\n' ' '; echo; \
  $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__, torch.cuda.get_device_name())'"
# Spread over the host's cores where pytest-xdist is there (the CPU kernel tests are most of the count)
xdist=()
"$PY" -c 'import xdist' 2>/dev/null && xdist=(-n 8)
# The weights do not travel to the GPU machine (538 MB): without them the pinned-bytes check is
# left out, and the benches time random weights of the same shapes
deselect=() random_weights=()
if [[ ! -f $MODEL/model.safetensors ]]; then
  deselect=(--deselect tests/kernels/test_model_fetch.py::test_test_model_has_pinned_bytes)
  random_weights=(--random-weights)
fi
run_step kernel-tests 150 env OMP_NUM_THREADS=2 "$PY" -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} tests/kernels \
  ${deselect[@]+"${deselect[@]}"} --junitxml="$RES/kernel_tests.xml"
run_step kernel-bench 120 "$PY" bench/kernel_bench.py --skip lora --json "$RES/kernel_bench.json"
# Multi-LoRA shrink/expand at Llama-3-8B's qkv shape: each case checked against the torch
# reference (the step fails on a mismatch) and timed, with a K-split shrink beside the default.
run_step lora 60 "$PY" bench/kernel_bench.py --only lora --json "$RES/lora_bench.json"

# Host vs device time of one decode step (launches, syncs, top operators): is the step bound by the GPU or by the host?
run_step step-trace 60 "$PY" bench/gpu_step_trace.py --device cuda --batch 16 --model "$MODEL" ${random_weights[@]+"${random_weights[@]}"}

if [[ ! -f bench/throughput.py ]]; then
  msg="SKIPPED engine throughput: bench/throughput.py is not in this tree (the lead's script)"
  echo "$msg" | tee -a "$LOG"; status+=("$msg")
else
  extra=()
  help=$("$PY" bench/throughput.py --help 2>/dev/null || true)
  [[ $help == *--out* ]] && extra+=(--out "$RES")
  if [[ ! -f $MODEL/model.safetensors ]]; then
    # The weights (538 MB) exceed what travels to a lent GPU machine; the
    # speed of a step does not depend on the weights' values.
    if [[ $help == *--random-weights* ]]; then
      extra+=(--random-weights)
      echo "NOTE: $MODEL/model.safetensors absent: throughput with random weights" | tee -a "$LOG"
    else
      echo "NOTE: $MODEL/model.safetensors absent and throughput.py has no --random-weights: expect a failure" | tee -a "$LOG"
    fi
  fi
  # 4 one-at-a-time HF requests instead of 16: HF's per-token overhead dominates this step's time
  # (with 8, the step ran past 150 s on the H200, 2026-12-04)
  run_step throughput 180 "$PY" bench/throughput.py --device cuda --dtype bfloat16 --model "$MODEL" --hf-single-sample 4 ${extra[@]+"${extra[@]}"}
fi

# Tensor parallelism, TP=2 over NCCL (bench/tensor_parallel.py: TP=1 and TP=2 step times side by
# side, per-rank all-reduce time, greedy tokens compared): only where this machine has >= 2 GPUs.
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( ngpu >= 2 )); then
  run_step tensor-parallel 180 "$PY" bench/tensor_parallel.py --device cuda --dtype bfloat16 --model "$MODEL" --steps 10 ${random_weights[@]+"${random_weights[@]}"}
else
  msg="SKIPPED tensor-parallel: $ngpu GPU(s) here, TP=2 needs 2"
  echo "$msg" | tee -a "$LOG"; status+=("$msg")
fi

echo
echo "================ gpu_check summary ================"
for s in "${status[@]}"; do echo "$s"; done
grep -E "(passed|failed|error).* in [0-9.]+s" "$LOG" | tail -1
if [[ -f $RES/kernel_bench.json ]]; then
  "$PY" bench/kernel_bench.py --summary "$RES/kernel_bench.json"
fi
if [[ -f $RES/lora_bench.json ]]; then
  "$PY" bench/kernel_bench.py --summary "$RES/lora_bench.json"
fi
echo "full figures and log: $RES/"
for s in "${status[@]}"; do [[ $s == *rc=0* || $s == SKIPPED* ]] || exit 1; done
exit 0
