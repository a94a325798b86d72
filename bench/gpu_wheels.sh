#!/usr/bin/env bash
# Wheels for bench/gpu_checks.sh's WHEELS=DIR: the gRPC, API and metrics packages the CUDA tests
# import that a bare GPU image (CUDA torch, transformers, pytest, no network) lacks. Run it here,
# where PyPI is reachable; it takes the versions this checkout's .venv runs, for the GPU image's
# Python (default 3.12, x86-64 manylinux). grpcio and protobuf come too: the health service's
# generated code refuses an older grpcio than the one it was generated with.
#   bash bench/gpu_wheels.sh DIR [PYTHON_VERSION]
# Then carry DIR to the GPU machine and run: WHEELS=DIR bash bench/gpu_checks.sh OUT
set -euo pipefail
out=${1:?usage: bash bench/gpu_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
root=$(cd "$(dirname "$0")/.." && pwd)
names='grpcio|grpcio-health-checking|protobuf|openai|pydantic|pydantic_core|httpx2|httpcore2|anyio|sniffio|distro|jiter|tqdm|typing-inspection|typing_extensions|annotated-types|h11|idna|certifi|truststore|aiohttp|multidict|yarl|frozenlist|aiosignal|propcache|aiohappyeyeballs|attrs|prometheus_client|gguf|cryptography|cffi|pycparser|llguidance'
pins=$("$root/.venv/bin/python" -m pip list --format=freeze 2>/dev/null | grep -i -E "^($names)==" || true)
[ -n "$pins" ] || { echo "no pinned versions found: run 'make install' first" >&2; exit 2; }
mkdir -p "$out"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --dest "$out" --python-version "$py" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any $pins
ls "$out"
