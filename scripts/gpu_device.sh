#!/usr/bin/env bash
# On the GPU machine: install what scripts/gpu_wheels.sh put in .whl/, then each GPU check with its own time limit
# (each stage of scripts/gpu_check.sh, run apart so that one failing leaves the others to run).
# Usage: bash scripts/gpu_device.sh STAGE... (cuda_tests codec big quant strategies); logs and results go to $OUT.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# into the image's own site-packages: the benchmarks' workers start with a clean environment (no PYTHONPATH)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || exit 1
cp -r .whl/bnb_site/* .whl/minilm_site/* "$SITE"/ && echo "$PWD" > "$SITE/lightning_frozen_checkout.pth"
python3 -c "import torch,deepspeed,lightning,peft,transformers,bitsandbytes,lightning_frozen; print('torch',torch.__version__,'ds',deepspeed.__version__,'L',lightning.__version__,'peft',peft.__version__,'tf',transformers.__version__,'bnb',bitsandbytes.__version__, torch.cuda.get_device_name())" 2>&1 | tail -3
lscpu | grep -m1 "Model name"
stage() {
  local name=$1 t=$2; shift 2
  local start=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - start ))s"; grep -E "passed|failed|Error|error:|FAILED" "$OUT/$name.log" | tail -12
}
for s in "$@"; do case $s in
  cuda_tests) stage cuda_tests 200 python3 -m pytest -q -p no:cacheprovider -rA --durations=5 tests/test_cuda.py ;;
  codec) stage codec 60 python3 benchmarks/codec/run.py --millions 16 --repeats 3 ;;
  big) stage big 150 bash -c 'python3 benchmarks/big_model/run.py write --size 1.1b --data-dir /tmp/bench-data && python3 benchmarks/big_model/run.py run --size 1.1b --frozen-dtype nf4 --precision 32-true --devices 1 --steps 3 --no-resume --accelerator gpu --data-dir /tmp/bench-data --out benchmarks/big_model/results/gpu' ;;
  quant) stage quant 150 python3 benchmarks/quant/run.py --accelerator gpu --devices 1 --rounds 1 --out benchmarks/quant/results/gpu ;;
  strategies) stage strategies 300 python3 benchmarks/strategies/gpu.py ;;
esac; done
tar czf "$OUT/results.tgz" $(find benchmarks -path "*results/gpu*" -type f -newer scripts/gpu_device.sh) 2>/dev/null
ls -la "$OUT"
