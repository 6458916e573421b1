#!/usr/bin/env bash
# The GPU sessions behind docs/gpu.md: build fanrun on the GPU machine, then run the named
# parts (all when none is named), with nvidia-smi after each. Missing Python packages may be
# given as wheels in .whl/, and MLflow with what it needs in .whl/mlflow/ (for tracking-cost);
# programs in .whl/bin/ (a static fio, for checkpoint) go first on PATH.
#   benchmarks/gpu_session.sh [checks] [gpu-tests] [notebooks] [examples] [throughput] [launch] [tracking]
#   [checkpoint-tests] [checkpoint] [results] [stall] [watchdog-start] [watchdog-wait] [health] [restart]
#   [restart-tests] [warm-loop] [tracking-cost]
#   [data] [table]
# On eight GPUs:
#   CHECK_ARGS="--raise-rank 5 --kill-rank 3" RANKS="1 2 4 8" benchmarks/gpu_session.sh checks examples launch
# DRY_RUN=1 prints each step's command instead of running it, and installs nothing (the tests
# check that every step still names files, tests and arguments that exist).
set -u
OUT=${OUT:-/tmp/fanrun-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The figures are of cold calls unless a benchmark asks for warm ones (on this host a function's
# calls are warm by default).
export FANRUN_WARM=${FANRUN_WARM:-0}
if [ -z "${DRY_RUN:-}" ]; then
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz
    export PYTHONPATH=/tmp/site
  fi
  if [ -d .whl/mlflow ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-mlflow .whl/mlflow/*.whl
  fi
  python3 -m pip install -q --no-build-isolation --no-deps . || exit 1
fi
# Programs carried along (a static fio for the checkpoint part's disk limit).
[ -d .whl/bin ] && export PATH="$PWD/.whl/bin:$PATH"

after() {
  echo "--- nvidia-smi after $1"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  nvidia-smi --query-gpu=index,name,memory.used --format=csv
}
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${DRY_RUN:-}" ]; then
    printf 'step %s %s' "$name" "$limit"; printf ' %q' "$@"; echo
    return
  fi
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  after "$name" | tee -a "$OUT/$name.log"
}
pytest_step() {
  MLFLOW_TRACKING_URI=sqlite:////tmp/fanrun-mlflow.db step "$1" "$2" python3 -m pytest -q -p no:cacheprovider "${@:3}"
}

parts=${*:-checks gpu-tests notebooks throughput launch}
for part in $parts; do
  case $part in
    checks) step gpu_checks 200 python3 benchmarks/gpu_checks.py ${CHECK_ARGS:-} ;;
    # The examples as scripts, on every GPU (@distributed() with no arguments).
    examples)
      for example in ddp_quickstart fsdp deepspeed_zero; do
        (cd "$(mktemp -d)" && step "example_$example" 300 python3 "$OLDPWD/examples/$example.py")
      done ;;
    gpu-tests) pytest_step gpu_tests 200 tests/test_notebooks.py tests/test_tracking.py -k "gpu or cuda" -rs ;;
    notebooks)
      for test in ddp_quickstart fsdp deepspeed_zero from_torchdistributor kernel_interrupt; do
        pytest_step "notebook_$test" 200 tests/test_notebooks.py -k "$test and kernel"
      done ;;
    # The health gate on the real NVML: its cost (benchmarks/health.py), and its tests on GPUs (fanrun doctor --deep too).
    health)
      step health 120 python3 benchmarks/health.py --deep
      PYTHONPATH=/tmp/site-mlflow:${PYTHONPATH:-} pytest_step health_tests 200 tests/test_health.py -k "real_gpus" -rs ;;
    throughput) step throughput 300 python3 benchmarks/throughput.py --steps 100 --repeat 3 --kinds ${KINDS:-ddp fsdp} ;;
    # The launcher alone (fanrun) and with MLflow tracking, its default (tracked), side by side.
    launch) step launch 420 python3 benchmarks/launch.py --ranks ${RANKS:-1 2} --repeat ${REPEAT:-3} ${LAUNCH_ARGS:-} ;;
    tracking) step tracking ${TRACKING_LIMIT:-300} python3 benchmarks/tracking.py ${TRACKING_ARGS:-} ;;
    checkpoint-tests) pytest_step checkpoint_tests 300 tests/test_checkpoint.py tests/test_checkpoint_faults.py tests/test_checkpoint_fsdp.py ;;
    # The state dict on the GPUs, written to the machine's local disk.
    checkpoint)
      mkdir -p /tmp/fanrun-checkpoint-bench && df -h /tmp/fanrun-checkpoint-bench | tail -1
      FANRUN_TRACKING=0 step checkpoint 560 python3 benchmarks/checkpoint.py --device cuda --ranks 2 --dir /tmp/fanrun-checkpoint-bench ${CKPT_ARGS:---sizes 1} ;;
    # Large CUDA tensors returned by every rank, against torch.save + torch.load.
    results) FANRUN_TRACKING=0 step results 300 python3 benchmarks/results.py --device cuda --ranks ${RESULT_RANKS:-2} ;;
    # Stalls: the verdict's latency at fanrun's default stall timeout, watching's cost, torch's own timeout.
    stall) FANRUN_TRACKING=0 step stall 560 python3 benchmarks/stall.py --device cuda --ranks ${STALL_RANKS:-1} ${STALL_ARGS:-} ;;
    # torch's NCCL watchdog at its default timeout (10 min) outlasts a device call: one call starts it
    # in the background, and a later call on the same machine waits for it and keeps its log.
    watchdog-start)
      if [ -n "${DRY_RUN:-}" ]; then echo "step watchdog 900 python3 benchmarks/stall.py --device cuda --ranks 1 --parts torch --torch-timeout 0"; continue; fi
      FANRUN_TRACKING=0 setsid nohup timeout 900 python3 benchmarks/stall.py --device cuda --ranks 1 --parts torch \
        --torch-timeout 0 >/tmp/fanrun-watchdog.log 2>&1 </dev/null &
      echo "=== watchdog: started in the background at $(date +%T)" ;;
    watchdog-wait)
      [ -n "${DRY_RUN:-}" ] && continue
      for _ in $(seq 600); do pgrep -f "stall.py --device cuda --ranks 1 --parts torch" >/dev/null || break; sleep 1; done
      cp /tmp/fanrun-watchdog.log "$OUT/watchdog.log"; cat "$OUT/watchdog.log"; after watchdog | tee -a "$OUT/watchdog.log" ;;
    # From a rank's death to the next attempt's first step: fanrun keep and fresh, torchrun --max-restarts.
    restart) FANRUN_TRACKING=0 step restart 300 python3 benchmarks/restart.py --ranks ${RESTART_RANKS:-1} --repeat ${REPEAT:-3} ;;
    # A rank killed at step k over NCCL, and a survivor whose CUDA context failed (replaced, not kept).
    restart-tests) pytest_step restart_tests 200 tests/test_restart_in_place.py -k "gpu or cuda" -rs ;;
    # Back-to-back calls: cold, warm without and after a warmup, and kept.
    warm-loop) step warm_loop 420 python3 benchmarks/warm_loop.py --ranks ${LOOP_RANKS:-1} ${LOOP_ARGS:-} ;;
    # A call tracked against untracked, for a function that never imports mlflow and for one that does.
    tracking-cost)
      PYTHONPATH=/tmp/site-mlflow:${PYTHONPATH:-} step tracking_cost 420 python3 benchmarks/tracking_cost.py \
        --ranks ${COST_RANKS:-1} --repeat ${REPEAT:-3} --sleeps 0 ${COST_ARGS:-} ;;
    # The input pipeline on this host's CPUs: VolumeDataset against a plain Dataset over 200 x 10 MB files.
    data) step data 420 python3 benchmarks/data.py --full --corpora large --dir /tmp/fanrun-data-bench \
        --methods volume plain "volume, cold disk" "plain, cold disk" ${DATA_ARGS:-} ;;
    # A table of numeric columns, format="torch", warm and cold, against the disk's O_DIRECT read.
    table) step table 420 python3 benchmarks/table.py --numeric --rows ${TABLE_ROWS:-40000000} \
        --batch ${TABLE_BATCH:-65536} --methods fanrun ready-batches pyarrow --dir /tmp/fanrun-table-bench ${TABLE_ARGS:-} ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
