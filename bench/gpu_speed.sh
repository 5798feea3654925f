#!/usr/bin/env bash
# Issue 15's GPU rows in one call (≤ 10 min) on a lent GPU machine: decode speed and what the GPU waits for,
# the default-path RL step next to TRL's, and device memory over a 50-step compiled run.
# Carry [.whl, .models/qwen3-tokenizer] (bench/prepare_gpu_assets.sh); results land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
if [ -d .whl ] && [ ! -f .gpusite/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl \
    && touch .gpusite/.done
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for stage in ${STAGES:-rollout step memory}; do
  echo "=== $stage $(date +%T)"
  case "$stage" in
    rollout)  # decode: dynamic vs compiled static, reading tokens every 1 / 8 / 16 steps; profile of the last row
      timeout 170 python3 bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 \
        --new-tokens 64 --modes dynamic static+compile --sync-every 1 16 8 --profile --baseline-trajectories 0 \
        --out "$OUT/rollout_gpu.json" 2>&1 | grep -v "^  \|Loading" | tail -25 ;;
    step)     # one RL step: sleuth's default path (a recipe that says nothing) vs HF dynamic cache vs TRL
      timeout 220 python3 bench/train_step.py --model random:qwen2.5-0.5b --device cuda --prompts 8 --n 4 --turns 1 \
        --new-tokens 128 --steps 3 --variants sleuth-default sleuth trl-dynamic --timeout 100 \
        --out "$OUT/train_step_gpu.json" 2>&1 | tail -22 ;;
    memory)   # 50 steps with the default (compiled) decoding, 3 turns: device memory per step
      timeout 190 python3 bench/train_step.py --model random:qwen2.5-0.5b --device cuda --prompts 8 --n 4 --turns 3 \
        --new-tokens 64 --steps 50 --variants sleuth-default --timeout 180 \
        --out "$OUT/memory_50steps_gpu.json" 2>&1 | tail -8 ;;
  esac
done
