#!/usr/bin/env bash
# Issue 23's fused decode kernels A/B on one GPU, in one call (~6 min on an H100): the 0.5B short geometry
# (batch 64, 3 turns x 64 tokens) with the kernels unfused (SLEUTH_FUSED_DECODE=0), fused attention (auto splits),
# fused attention at 4 splits, and fused attention + the SiLU gate in the gate/up product (SLEUTH_FUSED_MLP=1),
# twice, interleaved, one process per row; then the 3B paper geometry unfused and fused. Rows go to $OUT.
#   run: carry [.whl, .models/qwen3-tokenizer]   bash bench/gpu_fused_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f .gpusite/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl \
    >/dev/null 2>&1 && touch .gpusite/.done
fi
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
row() {  # row FILE: the first row's headline numbers
  python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][0]
    print(sys.argv[1].rsplit("/", 1)[-1], f"hbm {r['hbm_fraction']:.4f} wall {r['wall_s']:.3f} s",
          f"prefill {r.get('prefill_s')} kernels {r.get('decode_kernels')}")
except Exception as err:
    print(sys.argv[1], "no row:", err)
PY
}
for rep in ${REPS:-1 2}; do
  for cfg in FUSED_DECODE=0 FUSED_DECODE=1 ATTENTION_SPLITS=4 FUSED_MLP=1; do
    f="$OUT/rollout_0.5b_short_fused_${cfg/=/_}_run$rep.json"
    env "SLEUTH_$cfg" timeout 150 python3 bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 \
      --new-tokens 64 --modes engine --baseline-trajectories 0 --out "$f" > "$OUT/log_short_${cfg/=/_}_run$rep.txt" 2>&1
    row "$f"
  done
done
for cfg in ${PAPER_CFGS:-FUSED_DECODE=0 FUSED_DECODE=1}; do
  f="$OUT/rollout_3b_paper_fused_${cfg/=/_}.json"
  env "SLEUTH_$cfg" timeout 200 python3 bench/rollout.py --model random:qwen2.5-3b --device cuda --batch 64 --turns 4 \
    --new-tokens 500 --max-obs-tokens 500 --modes engine --baseline-trajectories 0 --out "$f" > "$OUT/log_3b_${cfg/=/_}.txt" 2>&1
  row "$f"
done
