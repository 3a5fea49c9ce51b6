# SM90 backend (cuda-fused-linear-logp-sm90-contract-v1). Included by the top-level CMakeLists.txt
# when a CUDA compiler is found. Compiles for sm_90a
# only (wgmma, setmaxnreg); building needs no GPU. Links only the CUDA runtime: the driver's TMA
# encoder is reached through cudaGetDriverEntryPointByVersion at run time.
set(DETLOGP_SM90_DIR ${CMAKE_CURRENT_LIST_DIR})
get_filename_component(DETLOGP_SM90_ROOT ${DETLOGP_SM90_DIR}/../.. ABSOLUTE)

find_package(CUDAToolkit REQUIRED)
if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.3)
  message(FATAL_ERROR "detlogp SM90 backend needs nvcc >= 12.3 (found ${CMAKE_CUDA_COMPILER_VERSION})")
endif()

# CUDA sources compile as C++20 with exactly one -std flag, CMake's. nvcc >= 12 takes -std=c++20,
# but CMake 3.25 (Debian 12's) has no C++20 flag for nvcc: the library's cxx_std_20 requirement,
# which CMake applies to CUDA sources too, then fails at generation, and a CUDA_STANDARD it does
# know adds a second -std after the target's own options (nvcc warns "incompatible redefinition
# for option 'std'" and compiles the last one). So such a CMake is told the flag.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
# Targets with CUDA sources call detlogp_cuda_cxx20(<target>).
function(detlogp_cuda_cxx20 target)
  set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
endfunction()
detlogp_cuda_cxx20(detlogp)

# The CUDA lane pieces every CUDA backend shares (src/cuda): error checks, device validation and
# its verdict, device memory and the tensor-parallel device operations.
target_sources(detlogp PRIVATE
  ${DETLOGP_SM90_ROOT}/src/cuda/device.cpp
  ${DETLOGP_SM90_ROOT}/src/cuda/status.cpp
  ${DETLOGP_SM90_ROOT}/src/cuda/validate.cu)
# The SM90 backend: host side (.cpp) and the kernels (.cu: launch table, combine, logit gradient, the
# sampling program's and the top-k output's row kernels).
target_sources(detlogp PRIVATE
  ${DETLOGP_SM90_DIR}/backend.cpp
  ${DETLOGP_SM90_DIR}/heuristics.cpp
  ${DETLOGP_SM90_DIR}/tma.cpp
  ${DETLOGP_SM90_DIR}/workspace.cpp
  ${DETLOGP_SM90_DIR}/launch_table.cu
  ${DETLOGP_SM90_DIR}/combine.cu
  ${DETLOGP_SM90_DIR}/grad_logits.cu
  ${DETLOGP_SM90_DIR}/sample.cu
  ${DETLOGP_SM90_DIR}/topk.cu)

# Bit-relevant: --fmad=false keeps every multiply and add separately rounded unless the contract
# code asks for an fma explicitly (the _rn intrinsics of fpops.hpp are never contracted anyway).
# Never --use_fast_math. -Xptxas -v prints the registers/shared memory/spills of every kernel.
set(DETLOGP_SM90_CUDA_FLAGS
  "SHELL:-gencode arch=compute_90a,code=sm_90a"
  --fmad=false
  -Xptxas=-v
  -Xcompiler=-ffp-contract=off
  "-Xcompiler=-fmacro-prefix-map=${DETLOGP_SM90_ROOT}/=")
target_compile_options(detlogp PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${DETLOGP_SM90_CUDA_FLAGS}>)
target_link_libraries(detlogp PUBLIC CUDA::cudart)
# The non-contract cuBLAS lane (cuda-cublas-materialized). The contract kernels never call cuBLAS.
if(TARGET CUDA::cublas)
  target_sources(detlogp PRIVATE ${DETLOGP_SM90_ROOT}/src/cuda/cublas_materialized_backend.cu)
  target_link_libraries(detlogp PUBLIC CUDA::cublas)
else()
  target_sources(detlogp PRIVATE ${DETLOGP_SM90_ROOT}/src/cuda/cublas_unavailable.cpp)
endif()
target_compile_definitions(detlogp PUBLIC DETLOGP_WITH_SM90=1)

option(DETLOGP_BUILD_BENCH "Build the SM90 benchmark driver (links cuBLAS; the library never does)" ON)
if(DETLOGP_BUILD_BENCH AND EXISTS ${DETLOGP_SM90_ROOT}/bench/CMakeLists.txt AND NOT TARGET detlogp_bench_sm90)
  add_subdirectory(${DETLOGP_SM90_ROOT}/bench ${CMAKE_BINARY_DIR}/bench)
endif()
