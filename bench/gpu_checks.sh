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
# Stages (STAGES picks; the default set's limits add up to 510 s, inside one 10-minute call):
#   env                 GPU, driver, torch, transformers, accelerate versions
#   experts_invariance  bench/experts_invariance.py: is tiled_mm batch-invariant on this
#                       device at real widths (fp32, bf16)?
#   parity              bench/kernel_parity.py: decode/prefill parity per (family, dtype,
#                       attention) on this device; parity_gpt_oss: the same, eager only
#   real_width_fp32     bench/replay.py on Qwen3-Next-80B-A3B widths (4 of 48 layers) in
#                       fp32: decode/prefill label mismatches and speed
#   real_width          the same in bf16 with a grouped_mm comparison (not by default;
#                       measured 2026-12-04, README)
#   tiny_48l            the 48-layer tiny preset (not by default: its decode capture did
#                       not finish in 80 s on an H200)
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

STAGES=${STAGES:-env experts_invariance parity parity_gpt_oss real_width_fp32}
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
  stage experts_invariance 60 "$PYTHON" bench/experts_invariance.py --device "$DEVICE" \
    --experts 64 --hidden 256 --inter 64 --k 4 --tokens 300 --samples 8
  stage parity 120 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" --families qwen3_moe \
    --dtypes float32 --attention sdpa
  stage tiny 120 "$PYTHON" bench/replay.py --device "$DEVICE" --preset tiny-qwen3-next \
    --lengths 64 --windows 1 --repeats 1 --compare grouped_mm
  exit 0
fi
stage experts_invariance 60 "$PYTHON" bench/experts_invariance.py --device "$DEVICE"
stage parity 130 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" \
  --families qwen3_moe mixtral deepseek_v3 qwen3_next --dtypes float32 bfloat16 \
  --attention sdpa eager
stage parity_gpt_oss 40 "$PYTHON" bench/kernel_parity.py --device "$DEVICE" \
  --families gpt_oss --dtypes float32 bfloat16 --attention eager
stage real_width_fp32 220 "$PYTHON" bench/replay.py --device "$DEVICE" --dtype float32 \
  --preset qwen3-next-80b-a3b-4l --lengths 256 --windows 2 --repeats 1 --compare \
  --workdir /tmp/bench-real-width
stage real_width 260 "$PYTHON" bench/replay.py --device "$DEVICE" --dtype bfloat16 \
  --preset qwen3-next-80b-a3b-4l --lengths 1024 --windows 2 --repeats 2 \
  --compare grouped_mm --workdir /tmp/bench-real-width
stage tiny_48l 80 "$PYTHON" bench/replay.py --device "$DEVICE" --dtype float32 \
  --lengths 256 --windows 1 --repeats 1
