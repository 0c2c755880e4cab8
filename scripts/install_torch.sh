#!/usr/bin/env bash
# Install torch into the given Python without ever pulling a multi-GB CUDA build on a CPU host.
# - torch already importable: keep it (a GPU host's image usually has the right CUDA build).
# - otherwise install $TORCH_SPEC (default torch==2.13.0: on the project's CPU machines that
#   release's CPU build lies on local disk and pip takes it from there). On another CPU-only
#   machine point pip at a CPU wheel index first, e.g. PIP_EXTRA_INDEX_URL=<your CPU wheel index>.
set -euo pipefail
py=${1:-python3}
if "$py" -c "import torch" 2>/dev/null; then
  echo "torch $("$py" -c 'import torch; print(torch.__version__)') already installed"
  exit 0
fi
"$py" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
