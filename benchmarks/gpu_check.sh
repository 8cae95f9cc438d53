#!/bin/bash
# The GPU checks in one run (from the repository root on a machine with CUDA), each with its own time limit so the
# whole ends within ~9 minutes and its logs survive: the batched cascade and policy-learning benchmarks alone on the
# machine, then the learning-quality benchmark (3 modes x 3 seeds at once) beside the test suite.
#
#   OUT=gpu_check_out bash benchmarks/gpu_check.sh        # logs and a tarball of the runs' small files in $OUT
#
# Wheels of missing packages (monai, pytorch-ignite, nibabel, fire, termcolor) in .whl/ are installed first.
# DRY=1 rehearses the same steps on the CPU with tiny settings. END (seconds, default 510) bounds the second part.
# LQ_ARGS replaces the learning-quality benchmark's modes/seeds/shift (e.g. LQ_ARGS="--modes heuristic+mirror
# class-specific+joint --seeds 0 1 2 3 4 5" LQ_JOBS=12); TIMINGS=0 skips part 1; PYTEST_WORKERS (default 6).
# PYTEST_FIRST=S runs the test suite alone first (at most S seconds), then the learning-quality benchmark alone with
# the time left: each gets the machine's cores, and a suite cut short still leaves the benchmark its time.
# PASSED_LOG=FILE (a pytest.log of an earlier check, carried in an ignored folder) runs only the tests it does not
# show PASSED (tests/tools/skip_passed): the rest of a suite a lease cut short.
set -u
OUT=${OUT:-gpu_check_out}; mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
DEV=cuda; read -r -a LQ_EXTRA <<< "${LQ_ARGS:-}"; PYTEST=(-n "${PYTEST_WORKERS:-6}"); LQ_JOBS=${LQ_JOBS:-9}
END=${END:-510}
if [ "${DRY:-0}" = 1 ]; then
  DEV=cpu; LQ_EXTRA=(--modes heuristic+mirror --seeds 0 --set max_epochs=1 epoch_length=2)
  PYTEST=(tests/test_masked_adam.py); LQ_JOBS=1
fi
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/setup.log" 2>&1 || { echo "wheel install failed"; cat "$OUT/setup.log"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/setup.log" 2>&1
python3 -c "import torch, monai, ignite, jcsaug; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'monai', monai.__version__, 'ignite', ignite.__version__)" >> "$OUT/setup.log" 2>&1
echo "setup done t=$(elapsed)" > "$OUT/timeline.log"

# 1. timings, each alone on the machine
if [ "${TIMINGS:-1}" = 1 ]; then
timeout 60 python3 benchmarks/bench_device_cascade.py --device $DEV --repeats 5 > "$OUT/bench_device_cascade.log" 2>&1
echo "device cascade rc=$? t=$(elapsed)" >> "$OUT/timeline.log"
timeout 110 python3 benchmarks/bench_policy_learning.py --device $DEV > "$OUT/bench_policy_learning.log" 2>&1
echo "policy learning rc=$? t=$(elapsed)" >> "$OUT/timeline.log"
fi

if [ -n "${PASSED_LOG:-}" ]; then
  export JCSAUG_SKIP_PASSED=$PASSED_LOG PYTHONPATH=$PYTHONPATH:$PWD/tests/tools/skip_passed; PYTEST+=(-p skip_passed)
fi
TIMEOUT=(); python3 -c "import pytest_timeout" 2> /dev/null && TIMEOUT=(--timeout 600)  # one hung test fails alone
# (600: a test of three bundle trainings took 93 s alone on an H100 machine, likely over 300 s beside 12 runs)
run_tests() {  # -v: every test's name as it ends, so a cut run still names failures
  timeout "$1" python3 -m pytest -v -rf -p no:cacheprovider "${TIMEOUT[@]}" "${PYTEST[@]}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? t=$(elapsed)" >> "$OUT/timeline.log"
}
run_learning_quality() {
  timeout "$1" python3 benchmarks/bench_learning_quality.py --device $DEV --jobs $LQ_JOBS --threads 1 --out /tmp/lq \
    "${LQ_EXTRA[@]}" > "$OUT/bench_learning_quality.log" 2>&1
  echo "learning quality rc=$? t=$(elapsed)" >> "$OUT/timeline.log"
}

# 2. the test suite and the learning-quality benchmark: one after the other (PYTEST_FIRST), or side by side
if [ -n "${PYTEST_FIRST:-}" ]; then
  run_tests "$PYTEST_FIRST"
  run_learning_quality $(( END - $(elapsed) ))
else
  LEFT=$(( END - $(elapsed) ))
  run_learning_quality $LEFT &
  run_tests $(( LEFT - 20 )) &
  wait
fi
tar czf "$OUT/learning_quality_runs.tgz" -C /tmp/lq --exclude='*.pt' --exclude=tensorboard --exclude='*.png' \
  --exclude='*.nii.gz' . 2>> "$OUT/timeline.log"
echo "all done t=$(elapsed)" >> "$OUT/timeline.log"
cat "$OUT/timeline.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | tail -15
tail -30 "$OUT/bench_learning_quality.log"
