# CUTLASS 3.x sm90 kernels (TMA + wgmma, warp-specialized, fused regemm
# epilogue) for the CUDA module. Included from ffi/cuda/CMakeLists.txt after the
# `_regemm_cuda` target exists; adds its sources to it.
#
# REGEMM_CUTLASS=AUTO (default) builds them when the CUTLASS headers are found,
# ON requires them, OFF skips them. The headers come from REGEMM_CUTLASS_DIR (a
# CUTLASS source root) or else from the `nvidia-cutlass` wheel, which ships
# them as cutlass_library/source/{include,tools/util/include}.
#
# One kernel per translation unit (each takes about a minute: build in
# parallel), as kernels.cmake lists them. REGEMM_CUTLASS_DTYPES limits the
# dtypes (a quicker developer build); REGEMM_CUTLASS_PREBUILT names a directory
# of kernel objects built earlier by prebuild.sh with the same sources and flags
# (<name>.o), linked instead of compiled: the device machine's builds are on
# the clock.

set(REGEMM_CUTLASS AUTO CACHE STRING "Build the CUTLASS sm90 kernels: AUTO, ON or OFF")
set(REGEMM_CUTLASS_DIR "" CACHE PATH "CUTLASS source root; empty: the nvidia-cutlass wheel's")
set(REGEMM_CUTLASS_DTYPES "bf16;f16;f32" CACHE STRING "dtypes of the CUTLASS kernels (bf16, f16, f32 = TF32)")
# Default: .cutlass_prebuilt/ at the repository root, where prebuild.sh
# puts them for the device runs (git-ignored; used only if its stamp matches).
set(REGEMM_CUTLASS_PREBUILT "${PROJECT_SOURCE_DIR}/.cutlass_prebuilt" CACHE PATH
    "directory of prebuilt CUTLASS kernel objects to link instead of compiling")

string(TOUPPER "${REGEMM_CUTLASS}" REGEMM_CUTLASS)
if(REGEMM_CUTLASS STREQUAL "OFF")
  return()
endif()

set(_regemm_cutlass_root "${REGEMM_CUTLASS_DIR}")
if(NOT _regemm_cutlass_root)
  # find_spec, not import: the package's __init__ pulls in more than we need.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source') if s else '')"
    OUTPUT_VARIABLE _regemm_cutlass_root OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
if(NOT _regemm_cutlass_root OR NOT EXISTS "${_regemm_cutlass_root}/include/cutlass/cutlass.h")
  if(REGEMM_CUTLASS STREQUAL "ON")
    message(FATAL_ERROR "REGEMM_CUTLASS=ON but no CUTLASS headers found (pip install nvidia-cutlass, or set REGEMM_CUTLASS_DIR)")
  endif()
  message(STATUS "jax_regemm: CUTLASS headers not found; building without the CUTLASS sm90 kernels")
  return()
endif()
message(STATUS "jax_regemm: CUTLASS sm90 kernels from ${_regemm_cutlass_root}")

set(_regemm_cutlass_src "${CMAKE_CURRENT_LIST_DIR}")
include("${_regemm_cutlass_src}/kernels.cmake")  # the manifest: kernels, flags, stamps

# Kernels + dispatch: an object library of their own, compiled for sm_90a only
# (kernels.cmake's flags) whatever the module's CUDA_ARCHITECTURES are.
add_library(regemm_cutlass OBJECT "${_regemm_cutlass_src}/cutlass_dispatch.cu")
set_target_properties(regemm_cutlass PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
target_compile_features(regemm_cutlass PRIVATE cxx_std_17)
target_compile_options(regemm_cutlass PRIVATE ${REGEMM_CUTLASS_NVCC_FLAGS})  # CUDA sources only
target_include_directories(regemm_cutlass PRIVATE
  "${_regemm_cutlass_root}/include" "${_regemm_cutlass_root}/tools/util/include" "${_regemm_cutlass_src}"
  "${PROJECT_SOURCE_DIR}/ffi")

# Prebuilt objects count only if built from these very sources and flags (their
# family's stamp, kernels.cmake).
function(_regemm_cutlass_stamp_ok family out)
  set(${out} FALSE PARENT_SCOPE)
  set(stamp_file "${REGEMM_CUTLASS_PREBUILT}/${family}.sha256")
  if(NOT REGEMM_CUTLASS_PREBUILT OR NOT EXISTS "${stamp_file}")
    return()
  endif()
  regemm_cutlass_stamp(${family} "${_regemm_cutlass_root}" stamp)
  file(STRINGS "${stamp_file}" have LIMIT_COUNT 1)
  if(have STREQUAL stamp)
    set(${out} TRUE PARENT_SCOPE)
    message(STATUS "jax_regemm: linking prebuilt CUTLASS ${family} kernels from ${REGEMM_CUTLASS_PREBUILT}")
  else()
    message(WARNING "jax_regemm: ${stamp_file} was built from other sources; compiling those kernels")
  endif()
endfunction()
_regemm_cutlass_stamp_ok(fwd _regemm_prebuilt_fwd)
_regemm_cutlass_stamp_ok(dgrad _regemm_prebuilt_dgrad)

set(_regemm_cutlass_template_fwd cutlass_inst.cu.in)
set(_regemm_cutlass_template_dgrad cutlass_dgrad_inst.cu.in)
set(_regemm_cutlass_prebuilt_objs "")
regemm_cutlass_kernels("${REGEMM_CUTLASS_DTYPES}" _regemm_cutlass_rows)
foreach(_row IN LISTS _regemm_cutlass_rows)
  string(REPLACE "|" ";" _row "${_row}")
  list(GET _row 0 _family)
  list(GET _row 1 _name)
  list(GET _row 2 REGEMM_DT)
  list(GET _row 3 REGEMM_TA)
  list(GET _row 4 REGEMM_TB)
  list(GET _row 5 REGEMM_CFG)
  list(GET _row 6 REGEMM_ACT)
  list(GET _row 7 REGEMM_SLOT)
  if(_regemm_prebuilt_${_family} AND EXISTS "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
    list(APPEND _regemm_cutlass_prebuilt_objs "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
  else()
    set(_cu "${CMAKE_CURRENT_BINARY_DIR}/cutlass_inst/${_name}.cu")
    configure_file("${_regemm_cutlass_src}/${_regemm_cutlass_template_${_family}}" "${_cu}" @ONLY)
    target_sources(regemm_cutlass PRIVATE "${_cu}")
  endif()
endforeach()

# Into the module: the kernel objects, the prebuilt ones, and the registry
# entry (which speaks XLA FFI and the CUDA runtime, so it builds with the
# module's own settings).
target_link_libraries(_regemm_cuda PRIVATE regemm_cutlass)
target_sources(_regemm_cuda PRIVATE "${_regemm_cutlass_src}/cutlass_registry.cu" ${_regemm_cutlass_prebuilt_objs})
