#!/usr/bin/env bash
# The replay checks that need an accelerator, as one script for a short GPU lease.
#
# Run from the repository root on a machine with a CUDA torch and transformers (no
# install of this project needed: the package is assembled from the source folders
# under $PKG). Every stage has its own time limit and writes its JSON lines to
# $OUT/<stage>.jsonl as it goes, so a stage that overruns still leaves the others'.
#
#   OUT=/tmp/out bash bench/gpu_checks.sh            # DEVICE=cuda by default
#   OUT=/tmp/out DEVICE=cpu QUICK=1 bash bench/gpu_checks.sh   # a dry run of the script
#   OUT=/tmp/out STAGES="real_width" bash bench/gpu_checks.sh    # only these stages
#
# Stages:
#   env          GPU, driver, torch, transformers, accelerate versions
#   parity       bench/kernel_parity.py: decode/prefill parity per (family, dtype,
#                attention) on this device
#   real_width   bench/replay.py on Qwen3-Next-80B-A3B widths (4 of 48 layers, bf16)
#   tiny_48l     bench/replay.py on the 48-layer tiny Qwen3-Next preset
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the figures}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
PKG=${PKG:-/tmp/flywheel-pkg}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# hebrus_flywheel is the flywheel folder plus one stage folder per subpackage (pyproject's
# package-dir), put together with links so the source runs as it is.
rm -rf "$PKG" && mkdir -p "$PKG/hebrus_flywheel" && cp -r flywheel/. "$PKG/hebrus_flywheel/"
for stage in core schemas streams replay consumers train; do
  ln -s "$PWD/$stage" "$PKG/hebrus_flywheel/$stage"
done
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"

STAGES=${STAGES:-env parity parity_gpt_oss real_width tiny_48l}
stage() {  # stage NAME SECONDS COMMAND...: run it under a limit, keep its lines and log
  local name=$1 limit=$2; shift 2
  [[ " $STAGES " == *" $name "* || $QUICK = 1 ]] || return 0
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log"
  local rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" | tee -a "$OUT/stages.jsonl"
  grep -h '"figure"' "$OUT/$name.jsonl" | tail -n 60
  [ $rc -eq 0 ] || tail -n 15 "$OUT/$name.log"
}

mkdir -p "$OUT"
stage env 60 "$PYTHON" -c '
import json, torch, transformers
try:
    import accelerate; acc = accelerate.__version__
except ImportError:
    acc = None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"figure": "env", "value": gpu, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "transformers": transformers.__version__,
                  "accelerate": acc}))'

if [ "$QUICK" = 1 ]; then
  stage parity 120 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" --families qwen3_moe \
    --dtypes float32 --attention sdpa
  stage tiny 120 "$PYTHON" bench/replay.py --device "$DEVICE" --preset tiny-qwen3-next \
    --lengths 64 --windows 1 --repeats 1 --compare grouped_mm
  exit 0
fi
stage parity 130 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" \
  --families qwen3_moe mixtral deepseek_v3 qwen3_next --dtypes float32 bfloat16 \
  --attention sdpa eager
stage parity_gpt_oss 40 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" \
  --families gpt_oss --dtypes float32 bfloat16 --attention eager
stage real_width 260 "$PYTHON" bench/replay.py --device "$DEVICE" --dtype bfloat16 \
  --preset qwen3-next-80b-a3b-4l --lengths 1024 --windows 2 --repeats 2 \
  --compare grouped_mm --workdir /tmp/bench-real-width
stage tiny_48l 80 "$PYTHON" bench/replay.py --device "$DEVICE" --dtype float32 \
  --lengths 256 --windows 1 --repeats 1
