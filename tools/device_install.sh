#!/usr/bin/env bash
# Source this on the GPU machine (no network) before anything that imports
# jax_regemm there: it puts the CUTLASS headers of a carried wheel on the path
# (.whl/nvidia_cutlass-*.whl; build.cmake finds them through Python) and
# installs the package with the CUDA extension, linking the carried CUTLASS
# kernel objects (.cutlass_prebuilt, built here with ffi/cuda/cutlass/prebuild.sh)
# where their stamp matches the sources. On a machine that is still warm from
# an earlier call the build directory is kept, so this is an incremental build.
#   source tools/device_install.sh            (from the repository root)
if ls .whl/nvidia_cutlass*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export REGEMM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-16}"
if [ "${REGEMM_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install --no-build-isolation --no-deps -v . >"${OUT:-/tmp}/install.log" 2>&1 \
    || { tail -30 "${OUT:-/tmp}/install.log"; return 1 2>/dev/null || exit 1; }
  grep -i "jax_regemm:" "${OUT:-/tmp}/install.log" | head -3
fi
