#!/usr/bin/env bash
# FlashInfer's ReplaySSM GDN MTP kernels (flashinfer #5314, flashinfer-python 0.7.2.post1) in drift's
# sglang-replayssm flow, tried on a GPU machine: the real verify and commit where the GPU can run them
# (compute capability 10.x: SM100/SM103), and the adapter's own CUDA path over the contract's stand-in
# (tests/fixtures/fake_flashinfer.py) wherever there is a CUDA GPU.
#
#   bash scripts/flashinfer_check.sh prepare      # here, in the repository root, with PyPI reachable
#   bash scripts/flashinfer_check.sh run OUTDIR   # on the GPU machine, in the repository root
#
# With the device tool: command "bash scripts/flashinfer_check.sh run $OUT", carry [".whl"],
# timeout_s 600 (the steps' own limits add up to 570 s; on an SM90 GPU the real step is a refusal).
#
# prepare: puts into .whl/ (kept out of git through .git/info/exclude) what the GPU machine lacks
# for `import flashinfer.gdn_decode` under Python 3.12: apache-tvm-ffi's cp312 manylinux wheel and
# flashinfer-python 0.7.2.post1's Python files (its wheel, 62 MB, is mostly JIT sources under
# flashinfer/data/ that these functions never read; the files travel as a 15 MB zip, because a
# device call carries at most 64 MiB with the working tree). The GPU machine already has torch,
# numpy, nvidia-ml-py, cuda-bindings, click, einops, packaging, requests, tabulate and tqdm.
# Running the real kernels (SM100/SM103 only) also needs FlashInfer's CuTe DSL compiler, which this
# script does not carry: nvidia-cutlass-dsl==4.8.1 with nvidia-cutlass-dsl-libs-base==4.8.1 and
# nvidia-cutlass-dsl-libs-cu13==4.8.1 (92 MB alone: over one call's limit). On an SM90 GPU (an
# H200) drift's probe refuses the real kernels before they would need it, naming the capability.
#
# run: installs what .whl/ holds into /tmp/site, then (each step under a timeout, logs in OUTDIR):
#   real      drift run --device cuda with --kernel flashinfer-replayssm and FlashInfer's commit:
#             RAN (every check passed / a check failed) or SKIPPED (drift's refusal: what is missing);
#   stand-in  the same run over the stand-in: the adapter on CUDA, its step captured in a CUDA graph;
#   tests     tests/plug/test_flashinfer_replayssm.py -m cuda --drift-device cuda (graph capture
#             bit-identical to eager; the real kernels' test, skipped naming what is missing).
# OUTDIR holds six files (a device call brings back eight at most): summary.txt (one RESULT line per
# step; the README's sentence on the last real run quotes the first), env.txt, install.log and each
# step's log (drift's table).
set -u
MODE=${1:?usage: flashinfer_check.sh prepare | run OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
FI_VERSION=0.7.2.post1
TVM_FFI_VERSION=0.1.12
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

if [ "$MODE" = prepare ]; then
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    mkdir -p .whl
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
        -d "$tmp" "flashinfer-python==$FI_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION" || exit 1
    cp "$tmp"/apache_tvm_ffi-"$TVM_FFI_VERSION"-*.whl .whl/
    python3 - "$tmp"/flashinfer_python-"$FI_VERSION"-py3-none-any.whl ".whl/flashinfer-$FI_VERSION-py-files.zip" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:]
with zipfile.ZipFile(src) as whl, zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
    for name in whl.namelist():  # the package's Python files and its metadata; not flashinfer/data/
        if not name.startswith("flashinfer/data/") and (name.endswith((".py", ".json", "py.typed"))
                                                        or ".dist-info/" in name):
            out.writestr(name, whl.read(name))
import os
os.replace(dst + ".tmp", dst)
EOF
    rm -rf "$tmp"
    ls -l .whl
    exit 0
fi

[ "$MODE" = run ] || { echo "usage: flashinfer_check.sh prepare | run OUTDIR" >&2; exit 2; }
OUT=${2:?usage: flashinfer_check.sh run OUTDIR}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
SITE=/tmp/site
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        >"$OUT/install.log" 2>&1 || echo "installing .whl/*.whl failed (see install.log)"
fi
for z in .whl/flashinfer-*-py-files.zip; do
    [ -f "$z" ] && python3 -m zipfile -e "$z" "$SITE"
done
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "compute capability %d.%d" % torch.cuda.get_device_capability(0))
try:
    import flashinfer, flashinfer.gdn_decode as g
    print("flashinfer", flashinfer.__version__, "from", flashinfer.__file__,
          "| functions:", hasattr(g, "gated_delta_rule_mtp"), hasattr(g, "gated_delta_rule_replayssm_commit"))
except Exception as exc:
    print("flashinfer does not import:", repr(exc))
EOF

FIXTURE=tests/fixtures/fake_flashinfer.py
RUN=(-m drift run --device cuda --flow sglang-replayssm --preset qwen3-next-80b-tp16 --profile fp32 --steps 512 --lifecycle fixed)  # fixed: the step is captured
step() {  # step NAME TIMEOUT_S ARGS...: python3 ARGS under a timeout, its output in OUTDIR/NAME.log; sets RC
    local name=$1 limit=$2
    shift 2
    echo "=== $name: python3 $*" | tee -a "$SUMMARY"
    timeout "$limit" python3 "$@" >"$OUT/$name.log" 2>&1
    RC=$?
    tail -n 3 "$OUT/$name.log"
}
result() { echo "RESULT $*" | tee -a "$SUMMARY"; }

step real 150 "${RUN[@]}" --kernel flashinfer-replayssm --update drift.plug.flashinfer_replayssm:commit
refusal=$(grep -m1 'drift run: error:' "$OUT/real.log" | sed 's/^drift run: error: //')
case $RC in
    0) result "real: RAN, every check passed (512 steps, qwen3-next-80b-tp16, fp32; the table in real.log)" ;;
    1) result "real: RAN, a check failed: $(grep -m1 'drift run:' "$OUT/real.log")" ;;
    2) if echo "$refusal" | grep -q 'compute capability 10.x'; then
           gpu=$(echo "$refusal" | grep -o 'cuda:0 is [^;]*(SM[0-9]*)')
           result "real: SKIPPED, the GPU cannot run FlashInfer's ReplaySSM ($gpu; it needs SM100/SM103). drift's refusal: $refusal"
       else
           result "real: SKIPPED, drift's refusal: $refusal"
       fi ;;
    124) result "real: TIMED OUT after 150 s" ;;
    *) result "real: exit $RC (see real.log)" ;;
esac

step stand-in 240 "${RUN[@]}" --steps 256 --kernel "flashinfer-replayssm-op:$FIXTURE:api" --update "$FIXTURE:commit"
graph=$(grep -m1 '^graph capture' "$OUT/stand-in.log" | sed 's/  */ /g')
case $RC in
    0) result "stand-in: RAN, every check passed on CUDA (256 steps); graph capture: ${graph:-?}" ;;
    *) result "stand-in: exit $RC: $(grep -m1 'drift run:' "$OUT/stand-in.log")" ;;
esac

plugin=()
python3 -c "import importlib.metadata as m; m.distribution('drift')" 2>/dev/null || plugin=(-p drift.pytest_plugin)
step tests 180 -m pytest "${plugin[@]}" tests/plug/test_flashinfer_replayssm.py -m cuda --drift-device cuda -rs -q \
    -p no:cacheprovider
result "tests: exit $RC: $(grep -E '(passed|failed|skipped|error)' "$OUT/tests.log" | tail -n 1)"
grep -E '^SKIPPED' "$OUT/tests.log" | sed 's/^/  /' | tee -a "$SUMMARY"
echo "--- $SUMMARY"
cat "$SUMMARY"
