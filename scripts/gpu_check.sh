#!/usr/bin/env bash
# On a GPU machine: the SGLang backend's CUDA tests (CP4 prefill -> decode with the engines' KV in
# device memory, and the staging bandwidth), in one command, in under 5 minutes.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q -e '.[test,sglang]' && .venv/bin/pip install -q --no-deps sglang==0.5.23
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.cuda.get_device_name())"
exec timeout 280 .venv/bin/python -m pytest tests/engines/test_sglang_cuda.py -v -s -rs -p no:cacheprovider
