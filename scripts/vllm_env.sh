#!/usr/bin/env bash
# vLLM's own bookkeeping under test (tests/plug/test_vllm_engine.py: GPUModelRunner's
# _update_states_after_model_execute and GDNAttentionMetadataBuilder.build of vLLM 0.33.0 in the vllm
# flow, and a one-line mutation of each) in an environment of its own: a virtual environment over this
# one (--system-site-packages: drift, torch and the --no-deps vllm wheel seen through it) holding the
# CPU-side dependencies vLLM's modules import on the way (drift/plug/vllm_engine.py lists them).
# `pip install vllm==0.33.0` would replace torch with 2.14.0 and pull the CUDA 13 toolkit; these
# pins are what its resolution picks, installed under a constraint that keeps torch, numpy and
# transformers as they are. The tests must run here, not skip (DRIFT_REQUIRE_VLLM=1).
# Usage: bash scripts/vllm_env.sh [VENV_DIR]   (needs vllm==0.33.0 installed --no-deps, as .ci/run does)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/drift-vllm-env}"
python3 -m venv --system-site-packages "$venv"
python3 -c 'import numpy, torch, transformers
print(f"torch=={torch.__version__}\nnumpy=={numpy.__version__}\ntransformers=={transformers.__version__}")' \
    > "$venv/keep.txt"
"$venv/bin/python" -m pip install --quiet -c "$venv/keep.txt" psutil==7.2.2 cbor2==6.3.0 pyzmq==27.3.0 \
    aiohttp==3.14.5 oss-harmony==0.0.11 openai==3.60.0 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 \
    uvloop==0.23.0 prometheus_client==0.26.0 xgrammar==0.2.8 fastapi==0.136.3 \
    partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 einops==0.8.2 compressed-tensors==0.17.0
"$venv/bin/python" -c 'import torch; print("vllm env: torch", torch.__version__)'
DRIFT_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly tests/plug/test_vllm_engine.py
