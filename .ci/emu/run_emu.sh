#!/usr/bin/env bash
# The kernel under ../shared/tools/cuda_emu (the CPU emulation of attention_cuda/paged_attention.cu, see its
# README) with this directory's emu_driver.cpp, its copy of the shared driver extended for the 8-bit KV caches.
# The shared scripts take their driver from their own directory: they run from a copy with ours in its place.
#   .ci/emu/run_emu.sh [--mutants]     (CUDA_EMU: the shared tool, default ../shared/tools/cuda_emu; EMU_BUILD_DIR)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
EMU="${CUDA_EMU:-$ROOT/../shared/tools/cuda_emu}"
[ -f "$EMU/run_emu.sh" ] || { echo "no cuda_emu at $EMU (set CUDA_EMU)" >&2; exit 2; }
TOOL="$(mktemp -d)"
trap 'rm -rf "$TOOL"' EXIT
cp -r "$EMU"/. "$TOOL" && chmod -R u+w "$TOOL"
cp "$ROOT/.ci/emu/emu_driver.cpp" "$TOOL/emu_driver.cpp"
export EMU_BUILD_DIR="${EMU_BUILD_DIR:-$ROOT/build/cuda_emu}"
"$TOOL/run_emu.sh" "$ROOT" "$@"
