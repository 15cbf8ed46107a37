# ctest cuda_archs: cmake/cuda_archs.cmake's SPADE_CUDA_ARCHS values, with a stand-in nvcc (which
# targets it lists) and nvidia-smi (which GPUs this machine has) on PATH.
#   cmake -DSRC=<repo> -DWORK=<scratch dir> -P tests/cmake/test_cuda_archs.cmake
cmake_minimum_required(VERSION 3.20)
include(${SRC}/cmake/cuda_archs.cmake)
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK}/bin)

function(fake name text)
  file(WRITE ${WORK}/bin/${name} "#!/bin/sh\nprintf '${text}'\n")
  file(CHMOD ${WORK}/bin/${name} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
endfunction()
function(expect spec want)
  spade_cuda_architectures("${spec}" ${WORK}/bin/nvcc got)
  if(NOT got STREQUAL want)
    message(FATAL_ERROR "SPADE_CUDA_ARCHS=${spec}: got '${got}', want '${want}'")
  endif()
endfunction()

set(ENV{PATH} "${WORK}/bin:$ENV{PATH}")
# An nvcc without Blackwell targets.
fake(nvcc "sm_75\\nsm_80\\nsm_86\\nsm_87\\nsm_89\\nsm_90\\n")
expect(all "80-real;86-real;89-real;90a-real;90-virtual")
expect(hopper "90a-real;90-virtual")
expect("80-real;89-real" "80-real;89-real")
# One with them (sm_100, sm_120), then this machine's GPUs.
fake(nvcc "sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_103 sm_120 sm_121\\n")
expect(all "80-real;86-real;89-real;90a-real;100-real;120-real;120-virtual")
fake(nvidia-smi "9.0\\n9.0\\n")
expect(auto "90a-real;90-virtual")
fake(nvidia-smi "8.6\\n8.0\\n")
expect(auto "86-real;80-real")
# No GPU: Hopper (the fast build; `all` is the portable one).
file(WRITE ${WORK}/bin/nvidia-smi "#!/bin/sh\nexit 9\n")
expect(auto "90a-real;90-virtual")
message(STATUS "cuda_archs: every case as expected")
