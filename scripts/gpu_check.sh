#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and this project's packages installed (torch with CUDA, lightning,
# deepspeed, peft, transformers): the CUDA tests, then the GPU benchmark. About 5 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
if [ -f benchmarks/gpu_benchmark.py ]; then
    "$PYTHON" benchmarks/gpu_benchmark.py
fi
