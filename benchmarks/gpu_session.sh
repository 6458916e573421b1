#!/usr/bin/env bash
# The GPU session behind docs/gpu.md: build fanrun on the GPU machine, then run the core
# checks, the example notebooks in a real kernel, and the throughput and launch benchmarks,
# with nvidia-smi after each. Missing Python packages may be given as wheels in .whl/.
set -u
OUT=${OUT:-/tmp/fanrun-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps . || exit 1

after() {
  echo "--- nvidia-smi after $1"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  nvidia-smi --query-gpu=index,name,memory.used --format=csv
}
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  after "$name" | tee -a "$OUT/$name.log"
}

step gpu_checks 200 python3 benchmarks/gpu_checks.py
MLFLOW_TRACKING_URI=sqlite:////tmp/fanrun-mlflow.db step notebooks 200 python3 -m pytest tests/test_notebooks.py -q -p no:cacheprovider
step throughput 300 python3 benchmarks/throughput.py --steps 100 --repeat 3
# The launcher alone: MLflow tracking, on by default, is measured in benchmarks/tracking.py.
FANRUN_TRACKING=0 step launch 250 python3 benchmarks/launch.py --ranks 1 2 --repeat 3
