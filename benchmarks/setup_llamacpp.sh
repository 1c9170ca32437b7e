#!/usr/bin/env bash
# Build llama.cpp's benchmark tools from the llama-cpp-python sdist's vendored tree, for
# benchmarks/vs_llamacpp.py (llama-embedding for benchmarks/embeddings.py, llama-lookup for benchmarks/speculative.py). Not part of CI: about 15 minutes on a quiet 2-core machine.
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
# -march=native, except where the CPU has AMX: there this tree's AMX matmul stops with SIGILL at its
# first ldtilecfg (llama-bench, 1 or 2 threads, on an AMX Xeon), so the build names every other
# instruction set the CPU has and leaves AMX out.
ISA=(-DGGML_NATIVE=ON)
if grep -qw amx_int8 /proc/cpuinfo; then
  ISA=(-DGGML_NATIVE=OFF)
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    grep -qw "${pair%%:*}" /proc/cpuinfo && ISA+=("-DGGML_${pair##*:}=ON")
  done
fi
cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" >/dev/null
TOOLS=(llama-bench llama-batched-bench llama-perplexity llama-tokenize llama-quantize llama-embedding llama-lookup)
cmake --build build -j2 --target "${TOOLS[@]}"
ls -la "${TOOLS[@]/#/build/bin/}"
