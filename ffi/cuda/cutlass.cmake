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
# parallel), generated from cutlass_inst.cu.in for every dtype x A layout x B
# layout x tile configuration, plus, for the 16-bit dtypes, ping128x128c1
# kernels of one costly activation each (cutlass_kernels.h, kOneActs; the
# same lists as cutlass_prebuild.sh). REGEMM_CUTLASS_DTYPES limits the dtypes (a
# quicker developer build); REGEMM_CUTLASS_PREBUILT names a directory of
# kernel objects built earlier with the same sources and flags (<name>.o),
# linked instead of compiled: the device machine's builds are on the clock.

set(REGEMM_CUTLASS AUTO CACHE STRING "Build the CUTLASS sm90 kernels: AUTO, ON or OFF")
set(REGEMM_CUTLASS_DIR "" CACHE PATH "CUTLASS source root; empty: the nvidia-cutlass wheel's")
set(REGEMM_CUTLASS_DTYPES "bf16;f16;f32" CACHE STRING "dtypes of the CUTLASS kernels (bf16, f16, f32 = TF32)")
# Default: .cutlass_prebuilt/ at the repository root, where cutlass_prebuild.sh
# puts them for the device runs (git-ignored; used only if its stamp matches).
set(REGEMM_CUTLASS_PREBUILT "${PROJECT_SOURCE_DIR}/.cutlass_prebuilt" CACHE PATH
    "directory of prebuilt CUTLASS kernel objects to link instead of compiling")

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

# Kernels + dispatch: an object library of their own, compiled for sm_90a only
# (wgmma and setmaxnreg need the arch-specific target) whatever the module's
# CUDA_ARCHITECTURES are. -DNDEBUG is not optional: without it ptxas serializes
# the wgmma pipeline (warning C7510) and the kernels run 1.3-1.8x slower, so
# ptxas warnings are errors here.
add_library(regemm_cutlass OBJECT "${_regemm_cutlass_src}/cutlass_dispatch.cu")
set_target_properties(regemm_cutlass PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
target_compile_features(regemm_cutlass PRIVATE cxx_std_17)
target_compile_options(regemm_cutlass PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Xptxas=-Werror>)
target_include_directories(regemm_cutlass PRIVATE
  "${_regemm_cutlass_root}/include" "${_regemm_cutlass_root}/tools/util/include" "${_regemm_cutlass_src}")

# Prebuilt objects count only if built from these very sources (the stamps of
# ffi/cuda/cutlass_stamp.sh: keep the file lists equal): the forward kernels'
# stamp covers their sources; the dgrad kernels' stamp those and their own, so
# that changing a dgrad source rebuilds the dgrad kernels alone.
set(_regemm_cutlass_fwd_files
    "${_regemm_cutlass_src}/cutlass_inst.cu.in" "${_regemm_cutlass_src}/cutlass_gemm.cuh"
    "${_regemm_cutlass_src}/cutlass_epilogue.cuh" "${_regemm_cutlass_src}/cutlass_kernels.h"
    "${_regemm_cutlass_src}/../regemm/problem.h" "${_regemm_cutlass_src}/../regemm/activation.h"
    "${_regemm_cutlass_src}/../regemm/numeric.h" "${_regemm_cutlass_src}/../regemm/host_math.h"
    "${_regemm_cutlass_root}/include/cutlass/version.h")
set(_regemm_cutlass_dgrad_files ${_regemm_cutlass_fwd_files}
    "${_regemm_cutlass_src}/cutlass_dgrad_inst.cu.in" "${_regemm_cutlass_src}/cutlass_dgrad.cuh"
    "${_regemm_cutlass_src}/cutlass_dgrad.h")
function(_regemm_cutlass_stamp_ok files stamp_file out)
  set(${out} FALSE PARENT_SCOPE)
  if(NOT REGEMM_CUTLASS_PREBUILT OR NOT EXISTS "${REGEMM_CUTLASS_PREBUILT}/${stamp_file}")
    return()
  endif()
  set(_lines "")
  foreach(_f IN LISTS files)
    file(SHA256 "${_f}" _h)
    string(APPEND _lines "${_h}\n")
  endforeach()
  string(SHA256 _stamp "${_lines}")
  file(STRINGS "${REGEMM_CUTLASS_PREBUILT}/${stamp_file}" _have LIMIT_COUNT 1)
  if(_have STREQUAL _stamp)
    set(${out} TRUE PARENT_SCOPE)
    message(STATUS "jax_regemm: linking prebuilt CUTLASS kernels (${stamp_file}) from ${REGEMM_CUTLASS_PREBUILT}")
  else()
    message(WARNING "jax_regemm: ${REGEMM_CUTLASS_PREBUILT} (${stamp_file}) was built from other sources; compiling those kernels")
  endif()
endfunction()
_regemm_cutlass_stamp_ok("${_regemm_cutlass_fwd_files}" sources.sha256 _regemm_cutlass_use_prebuilt)
_regemm_cutlass_stamp_ok("${_regemm_cutlass_dgrad_files}" dgrad_sources.sha256 _regemm_cutlass_use_prebuilt_dgrad)

set(_regemm_cutlass_configs kCoop128x256 kPing128x128 kStreamK128x128 kPing128x128c1)
set(_regemm_cutlass_short_kCoop128x256 coop)
set(_regemm_cutlass_short_kPing128x128 ping)
set(_regemm_cutlass_short_kStreamK128x128 streamk)
set(_regemm_cutlass_short_kPing128x128c1 ping1)
set(_regemm_cutlass_enum_bf16 kBF16)
set(_regemm_cutlass_enum_f16 kF16)
set(_regemm_cutlass_enum_f32 kF32)
# Kernels of one activation: ping128x128c1, every dtype (kOneActs).
set(_regemm_cutlass_one_act_configs kPing128x128c1)
set(_regemm_cutlass_one_act_dtypes bf16 f16 f32)
set(_regemm_cutlass_one_acts gelu:kGelu gelu_erf:kGeluErf sigmoid:kSigmoid silu:kSilu)
set(_regemm_cutlass_prebuilt_objs "")
foreach(_dt IN LISTS REGEMM_CUTLASS_DTYPES)
  if(NOT DEFINED _regemm_cutlass_enum_${_dt})
    message(FATAL_ERROR "REGEMM_CUTLASS_DTYPES: unknown dtype '${_dt}' (bf16, f16, f32)")
  endif()
  foreach(_ta false true)
    foreach(_tb false true)
      foreach(_cfg IN LISTS _regemm_cutlass_configs)
        set(REGEMM_DT ${_regemm_cutlass_enum_${_dt}})
        set(REGEMM_TA ${_ta})
        set(REGEMM_TB ${_tb})
        set(REGEMM_CFG ${_cfg})
        string(SUBSTRING ${_ta} 0 1 _a)
        string(SUBSTRING ${_tb} 0 1 _b)
        set(_acts "any:")
        if(_cfg IN_LIST _regemm_cutlass_one_act_configs AND _dt IN_LIST _regemm_cutlass_one_act_dtypes)
          list(APPEND _acts ${_regemm_cutlass_one_acts})
        endif()
        foreach(_act IN LISTS _acts)
          string(REPLACE ":" ";" _act "${_act}")
          list(GET _act 0 _act_name)
          list(GET _act 1 _act_enum)
          set(_name "cutlass_${_dt}_${_a}${_b}_${_regemm_cutlass_short_${_cfg}}")
          if(_act_name STREQUAL "any")
            set(REGEMM_ACT kAnyAct)
          else()
            set(REGEMM_ACT "int(Act::${_act_enum})")
            string(APPEND _name "_${_act_name}")
          endif()
          if(_regemm_cutlass_use_prebuilt AND EXISTS "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
            list(APPEND _regemm_cutlass_prebuilt_objs "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
          else()
            configure_file("${_regemm_cutlass_src}/cutlass_inst.cu.in" "${CMAKE_CURRENT_BINARY_DIR}/cutlass_inst/${_name}.cu" @ONLY)
            target_sources(regemm_cutlass PRIVATE "${CMAKE_CURRENT_BINARY_DIR}/cutlass_inst/${_name}.cu")
          endif()
        endforeach()
      endforeach()
    endforeach()
  endforeach()
endforeach()

# regemm_dgrad_dact's kernels (cutlass_dgrad_inst.cu.in): A not transposed, B
# transposed (the weights of rg.mlp, flax and nnx) or not (bf16: Equinox's [out,
# in] weights; f32 there would be the transposed-problem layout), one per act
# slot (cutlass_dgrad.h, dgrad_act_slot; cutlass_prebuild.sh has the same list).
set(_regemm_cutlass_dgrad_kernels bf16:false bf16:true f16:true f32:true)
foreach(_k IN LISTS _regemm_cutlass_dgrad_kernels)
  string(REPLACE ":" ";" _k "${_k}")
  list(GET _k 0 _dt)
  list(GET _k 1 _tb)
  if(NOT _dt IN_LIST REGEMM_CUTLASS_DTYPES)
    continue()
  endif()
  foreach(_slot RANGE 5)  # 0 .. kNumDgradActSlots - 1
    set(REGEMM_DT ${_regemm_cutlass_enum_${_dt}})
    set(REGEMM_TB ${_tb})
    set(REGEMM_SLOT ${_slot})
    string(SUBSTRING ${_tb} 0 1 _b)
    set(_name "cutlass_dgrad_${_dt}_f${_b}_a${_slot}")
    if(_regemm_cutlass_use_prebuilt_dgrad AND EXISTS "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
      list(APPEND _regemm_cutlass_prebuilt_objs "${REGEMM_CUTLASS_PREBUILT}/${_name}.o")
    else()
      configure_file("${_regemm_cutlass_src}/cutlass_dgrad_inst.cu.in" "${CMAKE_CURRENT_BINARY_DIR}/cutlass_inst/${_name}.cu" @ONLY)
      target_sources(regemm_cutlass PRIVATE "${CMAKE_CURRENT_BINARY_DIR}/cutlass_inst/${_name}.cu")
    endif()
  endforeach()
endforeach()

# Into the module: the kernel objects, the prebuilt ones, and the registry
# entry (which speaks XLA FFI and the CUDA runtime, so it builds with the
# module's own settings).
target_link_libraries(_regemm_cuda PRIVATE regemm_cutlass)
target_sources(_regemm_cuda PRIVATE "${_regemm_cutlass_src}/cutlass_registry.cu" ${_regemm_cutlass_prebuilt_objs})
