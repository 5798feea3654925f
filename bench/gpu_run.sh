#!/usr/bin/env bash
# Runs on the lent GPU machine (torch/transformers from its image, sleuth from src/).
# Prepare what it carries with bench/prepare_gpu_assets.sh (on the development machine).
# Usage: bash bench/gpu_run.sh STAGE...   stages: setup, bench, s3
#   setup : install the carried wheels (.whl/) into .gpusite/, join the carried GGUF parts
#           (.gpu/p1, .gpu/p2) into .models/smollm2/ and check the sha256
#   bench : bench/rollout.py and bench/train_step.py (random-weight Qwen2.5-0.5B, real Qwen3 tokenizer)
#   s3    : `sleuth demo --profile gpu` on SmolLM2-135M-Instruct (resumable: rerun to continue)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GGUF=.models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"

for stage in "$@"; do
  case "$stage" in
    setup)
      if [ -d .whl ] && [ ! -f .gpusite/.done ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl \
          && touch .gpusite/.done
      fi
      mkdir -p .gpustore .models/smollm2
      for p in .gpu/p1/* .gpu/p2/*; do [ -f "$p" ] && cp "$p" .gpustore/; done
      if [ ! -f "$GGUF" ] && [ "$(ls .gpustore | wc -l)" -ge 2 ]; then
        cat .gpustore/ggufpart.* > "$GGUF.tmp"
        if [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" = "$GGUF_SHA" ]; then mv "$GGUF.tmp" "$GGUF"; echo "gguf joined, sha256 ok";
        else echo "gguf sha256 MISMATCH"; rm -f "$GGUF.tmp"; fi
      fi
      ls .gpustore .models/smollm2 ;;
    bench)
      python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
        --baseline-trajectories 4 --out "$OUT/rollout_gpu.json" 2>&1 | tail -40
      python bench/train_step.py --model random:qwen2.5-0.5b --device cuda --prompts 8 --n 4 --new-tokens 64 \
        --steps 3 --out "$OUT/train_step_gpu.json" 2>&1 | tail -40 ;;
    s3)
      timeout "${S3_TIMEOUT:-480}" python -m sleuth.cli demo --profile gpu --model "$GGUF" --out runs/gpu_s3 2>&1 \
        | grep -v "Loading weights\|Writing model" | tail -60
      for f in runs/gpu_s3/train/metrics.jsonl runs/gpu_s3/eval_before/summary.md runs/gpu_s3/eval_after/summary.md \
               runs/gpu_s3/report.html runs/gpu_s3/demo.json; do
        [ -f "$f" ] && cp "$f" "$OUT/$(echo "$f" | tr '/' '_')"
      done ;;
  esac
done
