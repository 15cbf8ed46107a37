# spade_cuda_architectures(spec nvcc out): the CMAKE_CUDA_ARCHITECTURES list for SPADE_CUDA_ARCHS.
#   auto    the GPUs of this machine (nvidia-smi: compute capability 9.0 -> 90a, the wgmma/TMA
#           kernels; others -> their own machine code); Hopper when none is found (a machine
#           without a GPU builds fast; `all` is the portable binary)
#   all     sm_80 (A100), 86 (RTX 30xx, A10, A40), 89 (RTX 40xx, L4, L40S), 90a (H100, H200),
#           and 100 / 120 (Blackwell) when this nvcc has them, plus PTX of the newest target
#   hopper  sm_90a + compute_90 PTX
#   else    taken as a CMake architecture list ("80-real;90a-real")
# The host picks the kernels by compute capability at run time (cuda_common.h cc_major, the
# wgmma prefill only on 9.0); a GPU the binary has no code for gets a clear error at start-up
# (check_device_supported).
function(spade_cuda_architectures spec nvcc out)
  execute_process(COMMAND "${nvcc}" --list-gpu-code OUTPUT_VARIABLE codes ERROR_QUIET
                  RESULT_VARIABLE rc)
  set(every "")
  set(newest "")
  foreach(a 80 86 89 90a 100 120)
    string(REGEX REPLACE "a$" "" n "${a}")
    if(NOT rc EQUAL 0 OR codes MATCHES "sm_${n}[^0-9]" OR codes MATCHES "sm_${n}$")
      list(APPEND every "${a}-real")
      set(newest "${n}")
    endif()
  endforeach()
  list(APPEND every "${newest}-virtual")
  if(spec STREQUAL "all")
    set(r "${every}")
  elseif(spec STREQUAL "hopper")
    set(r "90a-real;90-virtual")
  elseif(spec STREQUAL "auto")
    set(r "")
    execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps ERROR_QUIET RESULT_VARIABLE smi_rc)
    if(smi_rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
      list(REMOVE_DUPLICATES caps)
      foreach(c ${caps})
        string(REPLACE "." "" n "${c}")
        if(n LESS 80)
          message(WARNING "spade: a GPU of compute capability ${c} is not supported (8.0 or newer)")
        elseif(n EQUAL 90)
          list(APPEND r "90a-real" "90-virtual")
        else()
          list(APPEND r "${n}-real")
        endif()
      endforeach()
    endif()
    if(NOT r)
      set(r "90a-real;90-virtual")
      message(STATUS "spade: no GPU found, building for Hopper (SPADE_CUDA_ARCHS=all: every GPU)")
    endif()
  else()
    set(r "${spec}")
  endif()
  set(${out} "${r}" PARENT_SCOPE)
endfunction()
