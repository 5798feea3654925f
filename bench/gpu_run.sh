#!/usr/bin/env bash
# Runs on the lent GPU machine (torch/transformers from its image, sleuth from src/).
# Prepare what it carries with bench/prepare_gpu_assets.sh (on the development machine).
# Usage: bash bench/gpu_run.sh STAGE...   stages: setup, memcheck, bench, rollout, demo, s3, scale
#   setup    : install the carried wheels (.whl/) into .gpusite/, join the carried GGUF parts
#              (.gpu/p1, .gpu/p2) into .models/smollm2/ and check the sha256
#   memcheck : GPU memory in use after a bare `import bm25s` vs sleuth's import (JAX preallocation)
#   bench    : bench/train_step.py, sleuth vs TRL (random-weight Qwen2.5-0.5B, real Qwen3 tokenizer)
#   rollout  : bench/rollout.py (engine vs sequential generate)
#   demo     : `sleuth demo --profile gpu --method $METHOD [--steps $STEPS]` on SmolLM2-135M-Instruct
#              into runs/gpu_$METHOD (resumable: rerun to continue); s3 = demo with METHOD=s3
#   scale    : bench/scale_step.py, 1 vs 2 GPUs (DDP, FSDP2), random-weight Qwen2.5-1.5B
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
    memcheck)
      used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1; }
      echo "idle: $(used)"
      python3 -c "import bm25s, subprocess, time; time.sleep(1); print('after bare import bm25s:', subprocess.run(['nvidia-smi','--query-gpu=memory.used','--format=csv,noheader'], capture_output=True, text=True).stdout.split(chr(10))[0])" 2>&1 | tail -2
      python3 -c "from sleuth.retrieval.bm25 import import_bm25s; import subprocess, time; import_bm25s(); time.sleep(1); print('after sleuth import_bm25s:', subprocess.run(['nvidia-smi','--query-gpu=memory.used','--format=csv,noheader'], capture_output=True, text=True).stdout.split(chr(10))[0])" 2>&1 | tail -2 ;;
    bench)
      python bench/train_step.py --model random:qwen2.5-0.5b --device cuda --prompts 8 --n 4 --turns 1 \
        --new-tokens 128 --steps 3 --timeout "${VARIANT_TIMEOUT:-240}" --out "$OUT/train_step_gpu.json" 2>&1 | tail -30 ;;
    rollout)
      python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
        --baseline-trajectories 4 --out "$OUT/rollout_gpu.json" 2>&1 | tail -40 ;;
    demo|s3)
      method=${METHOD:-s3}; [ "$stage" = s3 ] && method=s3
      run=runs/gpu_$method
      timeout "${DEMO_TIMEOUT:-480}" python -m sleuth.cli demo --profile gpu --method "$method" --model "$GGUF" \
        ${STEPS:+--steps "$STEPS"} --out "$run" 2>&1 | grep -v "Loading weights\|Writing model" | tail -60
      for f in "$run"/train/metrics.jsonl "$run"/eval_before/summary.md "$run"/eval_after/summary.md \
               "$run"/eval_before/summary.json "$run"/eval_after/summary.json "$run"/report.html "$run"/demo.json; do
        [ -f "$f" ] && cp "$f" "$OUT/$(echo "$f" | tr '/' '_')"
      done ;;
    scale)
      python bench/scale_step.py --model random:qwen2.5-1.5b --gpus 1 2 --parallel ddp fsdp --prompts 8 --n 4 \
        --compile --turns 1 --new-tokens 128 --steps 3 --timeout "${SCALE_TIMEOUT:-240}" --out "$OUT/scale_step_gpu.json" \
        2>&1 | tail -30 ;;
  esac
done
