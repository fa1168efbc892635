# The manifest of the CUTLASS kernel objects: which kernels exist, the flags
# they are compiled with, and the stamp of the sources they are built from.
# build.cmake includes it; prebuild.sh runs it as a script:
#
#   cmake -DDTYPES="bf16;f16;f32" -P ffi/cuda/cutlass/kernels.cmake         one line per kernel
#   cmake -DSTAMP=fwd|dgrad -DCUTLASS_ROOT=DIR -P ffi/cuda/cutlass/kernels.cmake   a stamp
#   cmake -DFLAGS=1 -P ffi/cuda/cutlass/kernels.cmake                        the nvcc flags
#
# A kernel line is "family name DT TA TB CFG ACT SLOT": one translation unit,
# the template of its family (fwd: cutlass_inst.cu.in, dgrad:
# cutlass_dgrad_inst.cu.in) with @REGEMM_<field>@ replaced by the fields.
#
# fwd: every dtype x A layout x B layout x tile configuration, computing any
# activation (kAnyAct); for ping128x128c1 also one kernel per costly activation
# (cutlass_kernels.h, kOneActs, must list the same ones: the kernel table has a
# slot for each).
# dgrad (regemm_dgrad_dact): A not transposed, B transposed (the weights of
# rg.mlp, flax and nnx) or not (bf16: Equinox's [out, in] weights), one kernel
# per act slot (cutlass_dgrad.h, dgrad_act_slot).

set(_regemm_cutlass_dir "${CMAKE_CURRENT_LIST_DIR}")

# -DNDEBUG is not optional: without it ptxas serializes the wgmma pipeline
# (warning C7510) and the kernels run 1.3-1.8x slower, so ptxas warnings are
# errors. sm_90a only: wgmma and setmaxnreg need the arch-specific target.
set(REGEMM_CUTLASS_NVCC_FLAGS -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr
    -gencode=arch=compute_90a,code=sm_90a -Xptxas=-Werror)

function(regemm_cutlass_kernels dtypes out)
  set(enum_bf16 kBF16)
  set(enum_f16 kF16)
  set(enum_f32 kF32)
  set(configs coop:kCoop128x256 ping:kPing128x128 streamk:kStreamK128x128 ping1:kPing128x128c1)
  set(one_acts gelu:kGelu gelu_erf:kGeluErf sigmoid:kSigmoid silu:kSilu)
  set(dgrad_kernels bf16:false bf16:true f16:true f32:true)  # dtype:TB
  set(rows "")
  foreach(dt IN LISTS dtypes)
    if(NOT DEFINED enum_${dt})
      message(FATAL_ERROR "REGEMM_CUTLASS_DTYPES: unknown dtype '${dt}' (bf16, f16, f32)")
    endif()
    foreach(ta false true)
      foreach(tb false true)
        string(SUBSTRING ${ta} 0 1 a)
        string(SUBSTRING ${tb} 0 1 b)
        foreach(cfg IN LISTS configs)
          string(REPLACE ":" ";" cfg "${cfg}")
          list(GET cfg 0 short)
          list(GET cfg 1 cfg_enum)
          set(name cutlass_${dt}_${a}${b}_${short})
          list(APPEND rows "fwd|${name}|${enum_${dt}}|${ta}|${tb}|${cfg_enum}|kAnyAct|0")
          if(short STREQUAL "ping1")
            foreach(act IN LISTS one_acts)
              string(REPLACE ":" ";" act "${act}")
              list(GET act 0 act_name)
              list(GET act 1 act_enum)
              list(APPEND rows "fwd|${name}_${act_name}|${enum_${dt}}|${ta}|${tb}|${cfg_enum}|int(Act::${act_enum})|0")
            endforeach()
          endif()
        endforeach()
      endforeach()
    endforeach()
  endforeach()
  foreach(k IN LISTS dgrad_kernels)
    string(REPLACE ":" ";" k "${k}")
    list(GET k 0 dt)
    list(GET k 1 tb)
    if(dt IN_LIST dtypes)
      string(SUBSTRING ${tb} 0 1 b)
      foreach(slot RANGE 5)  # 0 .. kNumDgradActSlots - 1
        list(APPEND rows "dgrad|cutlass_dgrad_${dt}_f${b}_a${slot}|${enum_${dt}}|false|${tb}|-|-|${slot}")
      endforeach()
    endif()
  endforeach()
  set(${out} "${rows}" PARENT_SCOPE)
endfunction()

# The stamp of a family's sources: sha256 of the lines "<sha256 of file>" of each
# source, then of the flags. Prebuilt objects are linked only where theirs matches.
# The fwd stamp covers the forward kernels' sources; the dgrad stamp those and
# its own, so that a dgrad source change rebuilds the dgrad kernels alone.
function(regemm_cutlass_stamp family cutlass_root out)
  set(d "${_regemm_cutlass_dir}")
  set(files "${d}/cutlass_inst.cu.in" "${d}/cutlass_gemm.cuh" "${d}/cutlass_epilogue.cuh" "${d}/cutlass_kernels.h"
            "${d}/../../regemm/problem.h" "${d}/../../regemm/activation.h" "${d}/../../regemm/numeric.h"
            "${d}/../../regemm/host_math.h" "${cutlass_root}/include/cutlass/version.h")
  if(family STREQUAL "dgrad")
    list(APPEND files "${d}/cutlass_dgrad_inst.cu.in" "${d}/cutlass_dgrad.cuh" "${d}/cutlass_dgrad.h")
  endif()
  set(lines "")
  foreach(f IN LISTS files)
    file(SHA256 "${f}" h)
    string(APPEND lines "${h}\n")
  endforeach()
  string(APPEND lines "${REGEMM_CUTLASS_NVCC_FLAGS}\n")
  string(SHA256 stamp "${lines}")
  set(${out} "${stamp}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(DEFINED STAMP)
    regemm_cutlass_stamp("${STAMP}" "${CUTLASS_ROOT}" stamp)
    message(NOTICE "${stamp}")
  elseif(DEFINED FLAGS)
    list(JOIN REGEMM_CUTLASS_NVCC_FLAGS " " flags)
    message(NOTICE "${flags}")
  else()
    regemm_cutlass_kernels("${DTYPES}" rows)
    foreach(row IN LISTS rows)
      string(REPLACE "|" " " row "${row}")
      message(NOTICE "${row}")
    endforeach()
  endif()
endif()
