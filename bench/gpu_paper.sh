#!/usr/bin/env bash
# Issue 23's GPU runs as a resumable daemon on the lent machine (it outlives each <= 10 min call):
#   call 1: bash bench/gpu_paper.sh start   (carry .whl .models/qwen3-tokenizer) - starts the daemon, returns
#   then:   bash bench/gpu_paper.sh wait 540 - progress, and packs results into $OUT (<= 8 files)
#           bash bench/gpu_paper.sh restart  - after a fix: kills the daemon and starts it again; stages with a
#                                              done marker are skipped, a failed stage runs again
# On a 2-GPU / 32-core machine (next session's lease: issue 23's H100 rows, then issue 24's dense 21M chain):
#   1: carry [.whl, .models]  FRESH=1 SKIP_BM25=1 NLIST=8192 RETRIEVAL=1 bash bench/gpu_paper.sh start; bash bench/gpu_paper.sh wait 300
#   2: carry [.gpu/minilm]    bash bench/gpu_paper.sh wait 560;   then wait calls (daemon_next2 below; the
#      retrieval chain first, the 3B rows beside its CPU stages; estimate ~20 min of wall time in all)
# On a 4-GPU machine with issue 24's retrieval beside it (prepare: bash bench/prepare_gpu_assets.sh; ... retrieval;
# bash bench/gpu_learn.sh minilm), calls follow each other within the machine's idle time (~30 s):
#   1: carry [.whl, .models]  RETRIEVAL=1 bash bench/gpu_paper.sh start; bash bench/gpu_paper.sh wait 300
#   2: carry [.gpu/minilm]    bash bench/gpu_paper.sh wait 560
#   then wait calls; each packs results.tgz and retrieval/ into $OUT. (The guard40 stage, a GGUF run, needs the
#   GGUF halves carried in two more calls, [.gpu/p1] then [.gpu/p2]; PLAN=next no longer runs it: measured.)
# Stages (STAGES="decode capacity rollout paper3b fsdp3b paper7b" by default), each one command:
#   decode   : bench/decode.py, 0.5B/3B/7B shapes at batch 64 (HBM-bound fraction of the decode step)
#   capacity : bench/decode.py, 7B shape, 128 rows x 4,096 tokens (KV memory that fits one card)
#   rollout  : bench/rollout.py, 0.5B at batch 64: compiled static cache vs the decode engine, same card
#   paper3b  : bench/paper_scale.py, 3B LoRA on 1, 2, 4 GPUs (DDP)
#   fsdp3b   : bench/paper_scale.py, 3B full fine-tuning on 2 GPUs, DDP then FSDP2 (rollouts from the gathered copy)
#   paper7b  : bench/paper_scale.py, 7B full fine-tuning, FSDP2 on 4 GPUs (LoRA on 1 and 2 GPUs on a smaller machine)
# On a 4-GPU machine (and STAGES unset) the daemon runs daemon_next (PLAN=next, the default; see it) or, with
# PLAN=first, daemon4's plan, the one measured on 2026-11-27: weak scaling (PPG prompts per GPU)
# of 3B LoRA on 1 / 2 / 4 GPUs with rollout.py rows beside them on GPU 3, then 7B FSDP2 on 4, then 3B full
# fine-tuning DDP vs FSDP2 on 2 GPUs beside 3B full on 1 GPU (LoRA vs base) and the 3B/7B rollout rows; GPU 3
# is then handed to bench/retrieval_21m.sh's encoder (its CPU stages run beside all of this under taskset).
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${PAPER_WORK:-/root/paper}
mkdir -p "$WORK/done" "$WORK/results" "$WORK/logs"
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
R=$WORK/results
GPUS=$(nvidia-smi -L | wc -l)
ALL="1 2 4"; [ "$GPUS" -lt 4 ] && ALL="1 2"; [ "$GPUS" -lt 2 ] && ALL="1"

stage_cmd() {
  case "$1" in
    smoke) python bench/paper_scale.py --model random:qwen2.5-0.5b --lora --gpus 1 --prompts 2 --n 2 --turns 2 \
              --new-tokens 16 --max-obs-tokens 64 --steps 1 --micro 2 --work "$WORK/smoke" --out "$R/paper_scale_smoke.json" ;;
    decode) python bench/decode.py --models random:qwen2.5-0.5b random:qwen2.5-3b random:qwen2.5-7b --batches 64 \
              --context 512 --new-tokens 256 --out "$R/decode_gpu.json" ;;
    capacity) python bench/decode.py --models random:qwen2.5-7b --batches 128 --context 3584 --new-tokens 512 \
              --out "$R/decode_gpu_capacity.json" ;;
    rollout) python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
              --modes engine static+compile --baseline-trajectories 0 --out "$R/rollout_gpu_engine.json" ;;
    paper3b) python bench/paper_scale.py --model random:qwen2.5-3b --lora --gpus $ALL --prompts "${PROMPTS:-32}" \
              --steps 1 --micro 2 --work "$WORK/ps3b_lora" --out "$R/paper_scale_3b_lora.json" ;;
    fsdp3b) python bench/paper_scale.py --model random:qwen2.5-3b --gpus 2 --parallel ddp --prompts 16 --steps 1 --micro 2 \
              --work "$WORK/ps3b_full" --out "$R/paper_scale_3b_full_ddp.json" &&
            python bench/paper_scale.py --model random:qwen2.5-3b --gpus 2 --parallel fsdp --prompts 16 --steps 1 --micro 2 \
              --work "$WORK/ps3b_full" --out "$R/paper_scale_3b_full_fsdp.json" ;;
    # the 4-GPU plan (daemon4): each configuration in its own work folder, so lanes never share one
    p3b_1|p3b_2|p3b_4) g=${1#p3b_}
            python bench/paper_scale.py --model random:qwen2.5-3b --lora --gpus "$g" --prompts-per-gpu "${PPG:-16}" \
              --steps 1 --micro 2 --timeout 900 --work "$WORK/$1" --out "$R/paper_scale_3b_lora_${g}gpu.json" ;;
    p3b_full1) python bench/paper_scale.py --model random:qwen2.5-3b --gpus 1 --prompts-per-gpu "${PPG:-16}" --steps 1 \
              --micro 2 --timeout 900 --work "$WORK/$1" --out "$R/paper_scale_3b_full_1gpu.json" ;;
    p3b_ddp2|p3b_fsdp2) par=${1#p3b_}; par=${par%2}
            python bench/paper_scale.py --model random:qwen2.5-3b --gpus 2 --parallel "$par" --prompts-per-gpu "${PPG:-16}" \
              --steps 1 --micro 2 --timeout 900 --work "$WORK/$1" --out "$R/paper_scale_3b_full_${par}_2gpu.json" ;;
    p7b_fsdp4) python bench/paper_scale.py --model random:qwen2.5-7b --gpus 4 --parallel fsdp --prompts-per-gpu "${PPG7:-8}" \
              --steps 1 --micro 2 --timeout 900 --work "$WORK/$1" --out "$R/paper_scale_7b_full_fsdp_4gpu.json" ;;
    r_short) python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
              --modes engine static+compile --baseline-trajectories 0 --out "$R/rollout_0.5b_short.json" ;;
    r_short_base) [ -d .base/src ] && PYTHONPATH="$PWD/.base/src:$PWD/.gpusite" python bench/rollout.py \
              --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 --modes engine \
              --baseline-trajectories 0 --out "$R/rollout_0.5b_short_base.json" ;;  # a carried older checkout
    r_short_every) SLEUTH_STOP_FILTER=0 python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 \
              --turns 3 --new-tokens 64 --modes engine --baseline-trajectories 0 \
              --out "$R/rollout_0.5b_short_every_token_stop_check.json" ;;  # the stop check before StopEndTokens
    s_short) SLEUTH_SAMPLE_CHUNK=0 python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 \
              --new-tokens 64 --modes engine --baseline-trajectories 0 --out "$R/rollout_0.5b_short_one_program_sampler.json" ;;
    # f_short: the fused decode kernels A/B on one card, interleaved, one process per row (fused_kernels.py):
    # unfused (SLEUTH_FUSED_DECODE=0), fused attention (auto splits: 1 here), fused attention at 4 splits, and
    # with the SiLU gate in the gate/up product (SLEUTH_FUSED_MLP=1); each row's JSON records decode_kernels
    f_short) for rep in 1 2; do for cfg in FUSED_DECODE=0 FUSED_DECODE=1 ATTENTION_SPLITS=4 FUSED_MLP=1; do
              env "SLEUTH_$cfg" python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 \
                --new-tokens 64 --modes engine --baseline-trajectories 0 \
                --out "$R/rollout_0.5b_short_fused_${cfg}_run$rep.json" || return 1; done; done ;;
    # n_*: the same rows with every turn prefilled whole again (--no-prefix-reuse), the baseline on the same card
    n_short) python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
              --modes engine --no-prefix-reuse --baseline-trajectories 0 --out "$R/rollout_0.5b_short_noreuse.json" ;;
    n_paper05|n_paper3|n_paper7) m=${1#n_paper}; m=${m/05/0.5}
            python bench/rollout.py --model "random:qwen2.5-${m}b" --device cuda --batch 64 --turns 4 --new-tokens 500 \
              --max-obs-tokens 500 --modes engine --no-prefix-reuse --baseline-trajectories 0 \
              --out "$R/rollout_${m}b_paper_noreuse.json" ;;
    r_prof) python bench/rollout.py --model random:qwen2.5-0.5b --device cuda --batch 64 --turns 3 --new-tokens 64 \
              --modes engine --profile --baseline-trajectories 0 --out "$R/rollout_0.5b_short_profile.json" ;;
    r_paper05|r_paper3|r_paper7) m=${1#r_paper}; m=${m/05/0.5}
            python bench/rollout.py --model "random:qwen2.5-${m}b" --device cuda --batch 64 --turns 4 --new-tokens 500 \
              --max-obs-tokens 500 --modes engine --baseline-trajectories 0 --out "$R/rollout_${m}b_paper.json" ;;
    capacity256) python bench/decode.py --models random:qwen2.5-7b --batches 256 --context 3584 --new-tokens 512 \
              --out "$R/decode_gpu_capacity_256.json" ;;  # the issue's H200 case: 256 rows x 4,096 tokens at 7B
    encode_go) touch "$WORK/encode_go" ;;
    guard40)  # issue 26: a learning run (SmolLM2-135M, search_r1) of 48 RL steps under the default guards
            until [ -f .models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; do sleep 10; done  # carried in 2 calls
            # 1x H100, 2026-11-27: world + oracle + SFT (600 steps, 370 s) + 48 RL steps (850 s, of which 288 s
            # compiling decode at steps 1 and 4; ~11.7 s per other step) took 1,290 s, so DEMO_TIMEOUT=1500 cut the
            # final evaluation at 240 of 500 questions (~210 s); 500 take ~6-7 min, plus naive RAG and the report
            mkdir -p "$R/guard40" && METHOD=search_r1 STEPS=48 DEMO_TIMEOUT=2400 OUT="$R/guard40" \
              bash bench/gpu_run.sh demo ;;  # bench/retrieval_21m.sh (ENCODE_AFTER) may take GPU 3 from here on
    paper7b) if [ "$GPUS" -ge 4 ]; then
               python bench/paper_scale.py --model random:qwen2.5-7b --gpus "$GPUS" --parallel fsdp \
                 --prompts "${PROMPTS:-32}" --steps 1 --micro 2 --work "$WORK/ps7b" --out "$R/paper_scale_7b_full_fsdp.json"
             else  # 7B full fine-tuning needs ~122 GB of states: FSDP over 4+ cards; LoRA on fewer
               python bench/paper_scale.py --model random:qwen2.5-7b --lora --gpus $ALL --prompts 16 --steps 1 \
                 --work "$WORK/ps7b_lora" --out "$R/paper_scale_7b_lora.json"
             fi ;;
  esac
}

# The daemon is bench/lease_jobs.py's, running one of these plans (each stage a job: `stage NAME` below, its
# done-marker $WORK/done/NAME; a job after others waits for them to end, as a phase did):
#   4 GPUs, STAGES unset: bench/plans/paper_next4.json (PLAN=next, the default) or paper_first4.json (PLAN=first)
#   2 GPUs, STAGES unset, PLAN=next: bench/plans/paper_next2.json
#   otherwise: $WORK/paper_stages.json, STAGES one after another on every GPU
choose_plan() {
  if [ "$GPUS" -ge 4 ] && [ -z "${STAGES:-}" ]; then
    if [ "${PLAN:-next}" = next ]; then echo bench/plans/paper_next4.json; else echo bench/plans/paper_first4.json; fi
  elif [ "$GPUS" -eq 2 ] && [ -z "${STAGES:-}" ] && [ "${PLAN:-next}" = next ]; then echo bench/plans/paper_next2.json
  else
    python3 - "$WORK/paper_stages.json" ${STAGES:-smoke decode capacity rollout paper3b fsdp3b paper7b} <<'PYEOF'
import json, sys
jobs = [{"id": "setup", "run": "bash bench/gpu_run.sh setup"}]
jobs += [{"id": s, "run": f"bash bench/gpu_paper.sh stage {s}", "after": ["setup"]} for s in sys.argv[2:]]
plan = {"work": "$PAPER_WORK", "lanes": 1, "jobs": jobs, "pack": ["results", "logs", "progress.log"]}
open(sys.argv[1], "w").write(json.dumps(plan, indent=1))
PYEOF
    echo "$WORK/paper_stages.json"
  fi
}

plan_file() {  # the plan `start` chose (before any start: the one it would choose)
  if [ -f "$WORK/plan_path" ]; then cat "$WORK/plan_path"; else choose_plan; fi
}

retrieval_reached() {  # retrieval_reached STAGE: when bench/retrieval_21m.sh runs beside, until it passed STAGE
  if [ -f runs/scale21m/daemon.log ]; then
    until [ -f "runs/scale21m/stages/$1.json" ] || [ -f runs/scale21m/daemon.finished ]; do sleep 15; done
  fi
}

pack() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/results.tgz" -C "$WORK" results logs progress.log 2>/dev/null
  { cat "$WORK/progress.log"; for l in "$WORK"/logs/*.log; do echo "== $l"; tail -c 3000 "$l"; done; } \
    > "$OUT/gpu_paper_log.txt" 2>/dev/null
}

export PAPER_WORK=$WORK
case "${1:-}" in
  stage) stage_cmd "$2" ;;  # one job of the plan
  retrieval_reached) retrieval_reached "$2" ;;
  start|restart)
    # FRESH=1 (a session's first call): forget stage markers and results a machine kept from an earlier lease
    # (seen on 2026-11-27: /root/paper survived), so every stage measures this checkout
    if [ "${FRESH:-0}" = 1 ]; then rm -rf "$WORK/done" "$WORK/results" "$WORK/logs" runs/scale21m
      mkdir -p "$WORK/done" "$WORK/results" "$WORK/logs"; fi
    for s in ${REDO:-}; do rm -f "$WORK/done/$s"; done
    [ -f "$WORK/progress.log" ] && mv "$WORK/progress.log" "$WORK/progress.$(date +%s).log"
    bash bench/gpu_run.sh setup > "$WORK/logs/setup0.log" 2>&1  # wheels once, before either daemon imports them
    # RETRIEVAL=1 on 2+ GPUs and 32+ cores: the benches on the cores from 16 up, issue 24's retrieval on cores 0-15
    # (the issue's 16-core machine; its encoder takes every core and GPU once the benches hand over)
    # cores from the affinity mask: `nproc` answers OMP_NUM_THREADS (4, exported above), which on 2026-11-27 kept
    # RETRIEVAL=1 from ever starting the retrieval chain on a 64-core machine
    cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
    pin=""; [ "$GPUS" -ge 2 ] && [ "$cores" -ge 32 ] && [ "${RETRIEVAL:-0}" = 1 ] && pin="taskset -c 16-$(( cores - 1 ))"
    choose_plan > "$WORK/plan_path"
    $pin python3 bench/lease_jobs.py restart "$(cat "$WORK/plan_path")"  # the daemon keeps the pinned cores
    if [ -n "$pin" ]; then  # issue 24's 21M retrieval on 16 cores of its own; its encoder waits for encode_go
      ivf=cuda:0; [ "$GPUS" -eq 2 ] && ivf=cuda:1  # the daemons run benches on the other GPUs beside it
      IVF_DEVICE=${IVF_DEVICE:-$ivf} ENCODE_AFTER="$WORK/encode_go" ENCODE_CPUS="0-$(( cores - 1 ))" WORKERS=16 taskset -c 0-15 \
        bash bench/retrieval_21m.sh start 2>&1 | tail -3
    fi
    sleep 5; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; cat "$WORK/progress.log" ;;
  wait)
    [ -d .gpu/minilm ] && bash bench/retrieval_21m.sh take
    ls .gpu/p1 .gpu/p2 > /dev/null 2>&1 && bash bench/gpu_run.sh setup > /dev/null 2>&1  # GGUF halves, joined
    OUT= python3 bench/lease_jobs.py wait "$(plan_file)" "${2:-540}" | cut -c1-300
    for f in "$R"/paper_scale_*.json; do [ -f "$f" ] && python3 -c "import json,sys; [print(r['config'], r['status'], *r.get('log_tail', [])[:45], sep=chr(10)) for r in json.load(open(sys.argv[1]))['rows'] if r['status'] != 'ok']" "$f"; done
    pack; [ -f runs/scale21m/daemon.log ] && { bash bench/retrieval_21m.sh status; OUT="$OUT/retrieval" bash bench/retrieval_21m.sh pack >/dev/null 2>&1; } ;;
  pack) pack ;;
  status|stop) python3 bench/lease_jobs.py "$1" "$(plan_file)" ;;
  *) echo "usage: $0 start|restart|wait SECONDS|pack|status|stop" >&2; exit 2 ;;
esac
