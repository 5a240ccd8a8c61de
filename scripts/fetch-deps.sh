#!/usr/bin/env bash
# Fills the git-ignored .deps folder with what the build needs beyond the CUDA toolkit:
#   .deps/googletest         GoogleTest sources (the GPU machine has none; copied from Debian's)
#   .deps/cudnn-frontend     the cuDNN frontend's headers (header-only; PyPI nvidia-cudnn-frontend)
# CMake runs it when the frontend is missing; scripts/device-check.sh's caller carries .deps to the
# GPU machine, which has no network.
set -euo pipefail
cd "$(dirname "$0")/.."
frontend_version=1.19.0  # recommended for cuDNN 9.19, the one on the H200 machine
mkdir -p .deps
if [ ! -f .deps/googletest/CMakeLists.txt ] && [ -f /usr/src/googletest/CMakeLists.txt ]; then
  cp -r /usr/src/googletest .deps/googletest
fi
if [ ! -f .deps/cudnn-frontend/include/cudnn_frontend.h ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
    "nvidia-cudnn-frontend==$frontend_version"
  python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("include/"):
            z.extract(name, ".deps/cudnn-frontend")
PY
fi
echo ".deps: googletest $( [ -f .deps/googletest/CMakeLists.txt ] && echo ok || echo missing )," \
  "cudnn-frontend $( [ -f .deps/cudnn-frontend/include/cudnn_frontend.h ] && echo ok || echo missing )"
