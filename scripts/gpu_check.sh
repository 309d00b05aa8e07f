#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI does not have. Run from the repository root on a
# machine where torch sees a GPU, with SplitMQ installed (`pip install -e .`: the runtime finds
# the worker through its `splitmq.roles` entry points, which a checkout that is only on
# PYTHONPATH does not have) and SPLITMQ_TEST_DATA_DIR pointing at the datasets:
#
#     bash scripts/gpu_check.sh [--busy-only] [OUTPUT_DIR]
#
# 1. the quickstart job with its worker on the CPU and then on the GPU (same seed): both must
#    finish, and their accuracies must agree to within two points (four client threads make
#    the batch order vary from run to run);
# 2. the CUDA tests (codec device-to-host copies, the worker's data plane, a CUDA worker
#    against the CPU reference);
# 3. the embedded end-to-end tests, whose workers pick the GPU (workers.device = "auto");
# 4. how busy one worker keeps the GPU serving 16 clients (ResNet-18 on CIFAR-10 shapes,
#    float32 and bfloat16 smashed data, prefetch off and on): benchmarks/gpu_busy.py prints
#    its table and writes it into docs/benchmarks.md.
# --busy-only: the data plane's tests and step 4 alone (no datasets needed; sized to run in a
# few minutes of a lent device). Logs go to OUTPUT_DIR (default ./gpu-check). Exit status:
# non-zero if any step failed; 2 at once when torch sees no CUDA device.
set -uo pipefail
busy_only=0
if [ "${1:-}" = "--busy-only" ]; then
    busy_only=1
    shift
fi
out=${1:-gpu-check}
python=${PYTHON:-python3}
mkdir -p "$out"
status=0

if ! "$python" - <<'EOF'; then
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
    echo "gpu_check: needs a CUDA device that torch sees; nothing was checked" >&2
    exit 2
fi

busy() {  # step 4, after the data plane's own tests
    "$python" -m pytest -q -p no:cacheprovider tests/integration/test_cuda_worker.py \
        tests/unit/test_device_io.py -m "not slow" 2>&1 | tee "$out/pytest-plane.log" | tail -15
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    "$python" -m benchmarks.gpu_busy --write-docs 2>&1 | tee "$out/gpu-busy.log" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

if [ "$busy_only" -eq 1 ]; then
    busy
    exit $status
fi

accuracy() {  # the final global accuracy (percent) a run's summary printed
    grep -E 'final global accuracy' "$1" | grep -oE '[0-9.]+%' | head -1 | tr -d %
}

for device in cpu cuda; do
    start=$(date +%s.%N)
    SPLITMQ_WORKERS__DEVICE=$device "$python" -m services.cli.main run examples/quickstart.toml \
        --report-dir "${TMPDIR:-/tmp}/splitmq-gpu-runs" >"$out/quickstart-$device.log" 2>&1 || status=1
    end=$(date +%s.%N)
    echo "quickstart, worker on $device: $(accuracy "$out/quickstart-$device.log")% in" \
        "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s"
    tail -5 "$out/quickstart-$device.log"
done
cpu=$(accuracy "$out/quickstart-cpu.log")
gpu=$(accuracy "$out/quickstart-cuda.log")
if [ -z "$cpu" ] || [ -z "$gpu" ] || ! awk -v a="$cpu" -v b="$gpu" \
    'BEGIN { d = a - b; exit !(d <= 2 && d >= -2) }'; then
    echo "quickstart accuracy: CPU '$cpu'% vs GPU '$gpu'%: more than two points apart (or missing)"
    status=1
fi

"$python" -m pytest -q -p no:cacheprovider \
    tests/integration/test_cuda_worker.py \
    tests/integration/test_exactness.py \
    tests/integration/test_fedsplitx_e2e.py \
    tests/integration/test_feddeper_e2e.py \
    tests/integration/test_subfedavg_e2e.py \
    tests/integration/test_async_embedded.py \
    tests/unit/test_splitgp_inference.py \
    tests/unit/test_worker.py \
    -k "not rabbitmq" 2>&1 | tee "$out/pytest.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
busy
exit $status
