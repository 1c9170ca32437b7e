#!/usr/bin/env bash
# Build llama.cpp's benchmark tools from the llama-cpp-python sdist's vendored tree, for
# benchmarks/vs_llamacpp.py. Not part of CI: about 15 minutes on a quiet 2-core machine.
#   bash benchmarks/setup_llamacpp.sh [BUILD_DIR]   (default build/llamacpp)
set -euo pipefail
VERSION=0.3.36
DIR=${1:-build/llamacpp}
INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
mkdir -p "$DIR"
if [ ! -d "$DIR/src" ]; then
  # The sdist's link from the package index (pip download would build its metadata first).
  url=$(curl -fsS "$INDEX/llama-cpp-python/" | grep -o "https://[^\"#]*llama_cpp_python-$VERSION.tar.gz" | head -1)
  curl -fsSL "$url" -o "$DIR/sdist.tar.gz"
  mkdir -p "$DIR/src"
  tar -xzf "$DIR/sdist.tar.gz" -C "$DIR/src" --strip-components=1
fi
cd "$DIR/src/vendor/llama.cpp"
cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON >/dev/null
cmake --build build -j2 --target llama-bench llama-batched-bench llama-perplexity llama-tokenize llama-quantize
ls -la build/bin/llama-bench build/bin/llama-batched-bench build/bin/llama-perplexity build/bin/llama-tokenize build/bin/llama-quantize
