#!/usr/bin/env bash
# The CUDA path's checks and figures in one run, on a machine with an NVIDIA GPU and torch built for CUDA:
#   1. the tests that exercise the device: CUDA graph steps against eager ones (tests/unit/test_graphs.py), and the
#      engine and attention suites;
#   2. decode speed with and without CUDA graphs (benchmarks/cuda_decode.py, models of the real shapes).
# The gguf package is the one dependency such machines may lack: carry its wheel in .whl/ (from this checkout:
# python3 -m pip download --no-deps gguf==0.19.0 -d .whl) and it is installed to a scratch folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nextoken-site .whl/*.whl
    export PYTHONPATH="/tmp/nextoken-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/unit/test_graphs.py tests/unit/test_engine.py tests/unit/test_attention.py
python3 -m benchmarks.cuda_decode "$@"
