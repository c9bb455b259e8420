#!/usr/bin/env bash
# Builds llama.cpp (the independent reference the tests compare with) from the source vendored in
# the PyPI llama-cpp-python sdist, and prints the directory holding its programs. Cached under
# ${XDG_CACHE_HOME:-~/.cache}/xdna/llama.cpp/<version>-<cpu>: built for this CPU (GGML_NATIVE),
# so the key includes the CPU's flags. Needs cmake (PyPI `cmake`), a C++ compiler and pip.
# The programs: llama-perplexity, llama-quantize, llama-tokenize, llama-bench, and
# llama-speculative-simple (examples/; speculative decoding with a draft model, e.g.
# `--spec-type draft-dflash`, used by tools/llama-cpp/dflash_reference.py). A cache dir missing any
# of them is rebuilt whole.
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# Built without AMX: on an Emerald Rapids KVM host that exposes AMX, this version's AMX matrix
# kernels die with SIGILL (`tilezero` in `tinygemm_kernel_amx`, every thread count), so the
# reference keeps its AVX-512 VNNI kernels there, as on every CPU without AMX. GCC lets explicit
# -mno-* flags win over -march=native whatever their order. The key's "noamx" marks such builds.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cpu=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)-noamx
root="${XDG_CACHE_HOME:-$HOME/.cache}/xdna/llama.cpp"
dir="$root/$version-$cpu"
targets=(llama-perplexity llama-quantize llama-tokenize llama-bench llama-speculative-simple)
mkdir -p "$root"
work=$(mktemp -d "$root/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
sdist="$root/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$work" >&2
  mv "$work/llama_cpp_python-$version.tar.gz" "$sdist"
fi
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
# gguf-py, llama.cpp's own GGUF reader and writer (tools/llama-cpp/random_gguf.py uses it), beside
# the programs: $dir/gguf-py.
if [[ ! -f "$dir/gguf-py/gguf/__init__.py" && -x "$dir/bin/llama-quantize" ]]; then
  tar xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp/gguf-py"
  rm -rf "$dir/gguf-py"
  cp -r "$src/gguf-py" "$dir/gguf-py"
fi
built=1
for t in "${targets[@]}"; do [[ -x "$dir/bin/$t" ]] || built=0; done
# The draft log line below; a cache built without it is rebuilt.
[[ -f "$dir/draft-log-patch" ]] || built=0
if [[ $built == 1 ]]; then
  echo "$dir/bin"
  exit 0
fi
tar xzf "$sdist" -C "$work"
# One log line added to the speculative example (no computation changes): the token ids it drafted
# in every round, which llama.cpp logs for DFlash generation 1 only (as top-3 candidates).
sed -i 's|^\([[:space:]]*\)common_speculative_draft(spec);|&\n\1{ std::string xdna_ids; for (auto t : draft) { xdna_ids += std::to_string(t) + " "; } LOG_DBG("xdna: drafted at pos0 %d: %s\\n", (int) n_past, xdna_ids.c_str()); }|' \
  "$src/examples/speculative-simple/speculative-simple.cpp"
grep -q 'xdna: drafted at pos0' "$src/examples/speculative-simple/speculative-simple.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF \
  -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" -j"$(nproc)" --target "${targets[@]}" >&2
mkdir -p "$dir.tmp/bin"
for t in "${targets[@]}"; do cp "$work/build/bin/$t" "$dir.tmp/bin/"; done
cp -r "$src/gguf-py" "$dir.tmp/gguf-py"
touch "$dir.tmp/draft-log-patch"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
echo "$dir/bin"
