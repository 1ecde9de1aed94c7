#!/usr/bin/env bash
# The CUDA checks docs/speed.md ("Device graphs and GPU numbers") asks for, as one run on a GPU machine.
#
#   bash scripts/cuda_checks.sh WHEEL OUTDIR [SGLANG_FLA_DIR]
#
# WHEEL: a drift wheel (pip wheel --no-deps -w dist .), installed here without dependencies
# (the machine's own torch, numpy, scipy, pytest); OUTDIR: where the log and a JSON summary
# go; SGLANG_FLA_DIR (optional): a folder holding sglang/kernels/ops/attention/fla/{op,utils,
# fused_recurrent}.py from sglang 0.5.23, for the --kernel sglang-triton runs. sglang's parent
# packages import its whole runtime, so the runs stub them here (never in drift).
#
# Each step runs under a timeout, its output goes to OUTDIR/log.txt, and its exit status and
# wall time to OUTDIR/summary.jsonl; one failing step does not stop the others, and no step
# runs past the budget (CUDA_CHECKS_BUDGET_S, default 570 s).
set -u
WHEEL=${1:?usage: cuda_checks.sh WHEEL OUTDIR [SGLANG_FLA_DIR]}
OUT=${2:?usage: cuda_checks.sh WHEEL OUTDIR [SGLANG_FLA_DIR]}
FLA=${3:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.jsonl"
: >"$LOG"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-deps --no-index --force-reinstall "$WHEEL" >>"$LOG" 2>&1 || { echo "install failed"; tail "$LOG"; exit 1; }
python3 - >>"$LOG" 2>&1 <<'EOF'
import torch, drift
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "drift", drift.__file__)
EOF

DEADLINE=$(( $(date +%s) + ${CUDA_CHECKS_BUDGET_S:-570} ))  # the whole run's budget
step() {  # step NAME TIMEOUT_S COMMAND...: at most TIMEOUT_S, and never past the deadline
    local name=$1 limit=$2
    shift 2
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 20 ]; then
        printf '{"step": "%s", "rc": null, "skipped": "out of time"}\n' "$name" | tee -a "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0 t1 rc
    t0=$(date +%s%N)
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    t1=$(date +%s%N)
    printf '{"step": "%s", "rc": %d, "wall_s": %d.%03d}\n' "$name" "$rc" $(( (t1 - t0) / 1000000000 )) \
        $(( (t1 - t0) / 1000000 % 1000 )) | tee -a "$SUMMARY"
}

# sglang's Triton verify kernel behind stubbed parent packages, then drift's CLI.
TRITON_RUN=$(mktemp --suffix=.py)
cat >"$TRITON_RUN" <<'EOF'
import os, sys, types
import torch
fla_root = os.environ["SGLANG_FLA_DIR"]
for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention",
             "sglang.kernels.ops.attention.fla", "sglang.srt", "sglang.srt.utils"):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(fla_root, *name.split("."))]
    sys.modules[name] = mod
common = types.ModuleType("sglang.srt.utils.common")
common.torch_release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.modules["sglang.srt.utils.common"] = common
from drift.cli import main
sys.exit(main(sys.argv[1:]))
EOF

cd "$REPO"
# The test suite's CUDA tests (installed drift: `pytest`, not `python -m pytest`, keeps the
# checkout off sys.path) and the PR gate as an engine CI runs it, from outside the checkout.
# In order of what matters most, so that a short budget keeps the first ones: the CUDA tests, the
# captured step against the eager one (graph capture needs the fixed lifecycle: the serving default
# changes the batch between steps and runs eagerly), the default serving run, sglang's Triton kernel,
# then the gate as an engine CI runs it (installed drift, from outside the checkout) and the benches.
step cuda-tests 150 pytest tests -m cuda --drift-device cuda -q -p no:cacheprovider
step run-ci-captured 120 drift run --device cuda --steps 4096 --lifecycle fixed
step run-ci-eager 150 drift run --device cuda --steps 4096 --lifecycle fixed --no-graph
step run-ci-serving 150 drift run --device cuda --steps 4096
if [ -n "$FLA" ]; then
    export SGLANG_FLA_DIR="$FLA"
    step triton-ci 180 python3 "$TRITON_RUN" run --device cuda --kernel sglang-triton --steps 4096
fi
(cd /tmp && step gate 200 pytest --pyargs drift --drift-device cuda -q -p no:cacheprovider)
step bench-ci 90 drift bench --device cuda --preset ci-small
step bench-qwen 150 drift bench --device cuda --preset qwen3.5-397b-tp16
step run-qwen 150 drift run --device cuda --preset qwen3.5-397b-tp16 --steps 512
step run-stagnation 120 drift run --device cuda --preset stagnation
if [ -n "$FLA" ]; then
    step triton-stagnation 120 python3 "$TRITON_RUN" run --device cuda --kernel sglang-triton --preset stagnation
    step triton-qwen 150 python3 "$TRITON_RUN" run --device cuda --kernel sglang-triton --preset qwen3.5-397b-tp16 --steps 256
fi
cat "$SUMMARY"
