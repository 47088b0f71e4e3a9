#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (CI has none): the tests marked `cuda`, then `fedsight bench` on the
# GPU (the workloads, and the CNN at 200 clients a round, also on 1 and 2 ranks sharing the GPU), then the
# papers' recipes sequential against vectorised (benchmarks/vectorised_recipes.py) and DP-SGD sequential against
# vectorised at 20 clients (benchmarks/dp_vectorized.py), then, where torchvision and timm import (a GPU machine's
# image has them; this project's CPU wheel does not), the golden fixtures of tests/models/test_golden_weights.py into
# OUT_DIR/golden (copy them to tests/fixtures/golden and commit them). Run from the repository root
# with FedSight importable (installed, or PYTHONPATH=src) and the test extras (pytest, hypothesis); Flower is not needed.
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: gpu_check; logs and bench JSON files go there)
# Exit status: non-zero when no GPU is visible or a CUDA test fails; the bench figures are printed and saved.
set -uo pipefail
out=${1:-gpu_check}
mkdir -p "$out"
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: no CUDA GPU visible to torch" >&2
    exit 2
fi
"$py" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(), flush=True)" | tee "$out/device.txt"
export PYTHONUNBUFFERED=1
"$py" -m pytest -m cuda tests/test_device.py tests/test_vectorized.py -p no:cacheprovider -rs 2>&1 | tee "$out/cuda_tests.log"
tests=${PIPESTATUS[0]}
"$py" -m fedsight.cli bench --device cuda --no-flower --no-memory --force --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
"$py" -m fedsight.cli bench --device cuda -w cnn --clients 200 --nproc 2 --no-flower --no-memory --force --json "$out/bench_cnn200.json" \
    2>&1 | tee "$out/bench_cnn200.log"
"$py" benchmarks/vectorised_recipes.py --device cuda --clients 12 --rounds 4 2>&1 | tee "$out/recipes.log"
"$py" benchmarks/dp_vectorized.py --device cuda --clients 20 --rounds 2 2>&1 | tee "$out/dp_vectorized.log"
if "$py" -c "import torchvision, timm" 2>/dev/null; then
    "$py" benchmarks/golden_weights.py --out "$out/golden" 2>&1 | tee "$out/golden.log"
else
    echo "golden fixtures skipped: torchvision or timm does not import here" | tee "$out/golden.log"
fi
exit "$tests"
