#!/usr/bin/env bash
# One command for the DFlash draft of the default model on a fresh machine: a virtual environment
# with tools/dflash-train/requirements.txt (cached under ${XDG_CACHE_HOME:-~/.cache}/xdna), the
# release xdna binary (labels and the default model), llama.cpp's sdist (its converter exports the
# draft; tools/llama-cpp/build.sh fetches and caches it), then train.py with these arguments.
# Resumable: rerun with the same --out to continue. Example (the shipped draft):
#   bash tools/dflash-train/train.sh --out ~/dflash-run
set -euo pipefail
cd "$(dirname "$0")/../.."
cache="${XDG_CACHE_HOME:-$HOME/.cache}/xdna"
venv="$cache/dflash-train-venv"
req=tools/dflash-train/requirements.txt
if [[ ! -f "$venv/requirements.txt" ]] || ! cmp -s "$req" "$venv/requirements.txt"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --disable-pip-version-check -r "$req"
  cp "$req" "$venv/requirements.txt"
fi
cargo build --release --bin xdna
python3 -m pip install --quiet --disable-pip-version-check cmake
bash tools/llama-cpp/build.sh >/dev/null
exec "$venv/bin/python" tools/dflash-train/train.py "$@"
