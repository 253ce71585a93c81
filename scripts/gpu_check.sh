#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU and a CUDA build of PyTorch already installed
# (it installs nothing, so it also runs where no package registry can be reached).
# It builds the CUDA kernel, runs the GPU tests, and runs the attention benchmark on the GPU.
# About 3 to 5 minutes. Results go to $OUT (default: gpu_check_out/).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-gpu_check_out}"
mkdir -p "$out"

python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" | tee "$out/device.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k cuda 2>&1 | tee "$out/gpu_tests.txt"
python3 -m minillm.cli bench attention --device cuda --json > "$out/bench_attention_cuda.json"
python3 -m minillm.cli bench attention --device cuda --batches 1 16 64 --contexts 1024 4096 | tee "$out/bench_attention_cuda.txt"
