#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI does not have. Run from the repository root on a
# machine where torch sees a GPU, with SplitMQ importable (installed, or on PYTHONPATH) and
# SPLITMQ_TEST_DATA_DIR pointing at the datasets:
#
#     bash scripts/gpu_check.sh [OUTPUT_DIR]
#
# 1. the quickstart job with its worker on the CPU and then on the GPU (same seed): both must
#    finish, and their accuracies must agree to within two points (four client threads make
#    the batch order vary from run to run);
# 2. the CUDA tests (codec device-to-host copies, a CUDA worker against the CPU reference);
# 3. the embedded end-to-end tests, whose workers pick the GPU (workers.device = "auto").
# Logs go to OUTPUT_DIR (default ./gpu-check). Exit status: non-zero if any step failed.
set -uo pipefail
out=${1:-gpu-check}
python=${PYTHON:-python3}
mkdir -p "$out"
status=0

"$python" - <<'EOF' || exit 1
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF

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
exit $status
