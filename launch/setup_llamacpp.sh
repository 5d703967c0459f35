#!/usr/bin/env bash
# Set up ./.llamacpp (idempotent): llama.cpp's llama-server, the second real server that launch/bench/served checks
# exported drafters against, and the environment of its GGUF converter (trainer.export --format gguf).
#   .llamacpp/llama.cpp/        the sources vendored in PyPI's llama-cpp-python sdist (one pinned release)
#   .llamacpp/build/bin/        llama-server, built once with cmake (minutes: about ten on two cores)
#   .llamacpp/venv/             the converter's python: transformers 4.x and sentencepiece, as it wants them, beside
#                               the vendored gguf-py; apart from the project's .venv, which runs transformers 5
# Nothing in launch/setup.sh or CI's default run depends on it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CONVERTER_TRANSFORMERS=${LLAMACPP_TRANSFORMERS_VERSION:-4.57.6}
# Every core: nproc alone would honour a per-process OMP_NUM_THREADS=1 (as this project's processes and CI set it)
# and compile on one, twice the minutes on two cores.
JOBS=${JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
if [ "${1:-}" = "--jobs" ]; then echo "$JOBS"; exit 0; fi  # the compile jobs it would use, and nothing else
HOME_DIR=.llamacpp
mkdir -p "$HOME_DIR"

stamp="$HOME_DIR/llama.cpp/.from-llama-cpp-python-$VERSION"
if [ ! -f "$stamp" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$HOME_DIR/llama.cpp" "$HOME_DIR/build"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$HOME_DIR/llama.cpp"
  touch "$stamp"
fi

if [ ! -x "$HOME_DIR/build/bin/llama-server" ]; then
  started=$(date +%s)
  cmake -S "$HOME_DIR/llama.cpp" -B "$HOME_DIR/build" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release >"$HOME_DIR/cmake.log" 2>&1 \
    || { tail -30 "$HOME_DIR/cmake.log"; exit 1; }
  cmake --build "$HOME_DIR/build" -j"$JOBS" --target llama-server >>"$HOME_DIR/cmake.log" 2>&1 \
    || { tail -30 "$HOME_DIR/cmake.log"; exit 1; }
  echo "built llama-server in $(( $(date +%s) - started )) s ($JOBS jobs)"
fi

if [ ! -x "$HOME_DIR/venv/bin/python" ]; then
  "$PY" -m venv "$HOME_DIR/venv"
fi
if ! "$HOME_DIR/venv/bin/python" -m pip show transformers 2>/dev/null | grep -x "Version: $CONVERTER_TRANSFORMERS" >/dev/null; then
  # torch: the converter reads safetensors through it; the pinned CPU build, as in launch/setup.sh.
  "$HOME_DIR/venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" "numpy>=2,<2.3" "sentencepiece<0.3" \
    "protobuf>=4.21,<5" "transformers==$CONVERTER_TRANSFORMERS"
fi
# The checks: the server runs, and the converter imports with the vendored gguf-py.
"$HOME_DIR/build/bin/llama-server" --version 2>&1 | grep -m1 -i version
PYTHONPATH="$HOME_DIR/llama.cpp/gguf-py" "$HOME_DIR/venv/bin/python" -c \
  "import gguf, transformers, torch; print('converter: transformers', transformers.__version__, 'torch', torch.__version__)"
