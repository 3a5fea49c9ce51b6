# NCCL for the tensor-parallel communicator (include/detlogp/nccl.hpp). Looked for in the CUDA
# toolkit, the system, and the nvidia-nccl wheel of the python3 on PATH (PyTorch images ship
# NCCL that way). Optional: without it the operator still runs over any detlogp::Communicator.
option(DETLOGP_ENABLE_NCCL "Build the NCCL communicator when NCCL is found" ON)
set(DETLOGP_WITH_NCCL OFF)
if(DETLOGP_ENABLE_NCCL)
  set(_detlogp_nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _detlogp_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_detlogp_nccl_wheel)
      list(APPEND _detlogp_nccl_hints ${_detlogp_nccl_wheel})
    endif()
  endif()
  find_path(DETLOGP_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_detlogp_nccl_hints}
            PATH_SUFFIXES include)
  find_library(DETLOGP_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR} ${_detlogp_nccl_hints}
               PATH_SUFFIXES lib lib64)
  if(DETLOGP_NCCL_INCLUDE_DIR AND DETLOGP_NCCL_LIBRARY)
    set(DETLOGP_WITH_NCCL ON)
    target_sources(detlogp PRIVATE ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator.cpp)
    # An imported target rather than a path, so the installed package (detlogpConfig.cmake) can
    # define it again from where NCCL is on the consumer's machine.
    add_library(detlogp::nccl UNKNOWN IMPORTED)
    set_target_properties(detlogp::nccl PROPERTIES IMPORTED_LOCATION ${DETLOGP_NCCL_LIBRARY}
                                                   INTERFACE_INCLUDE_DIRECTORIES ${DETLOGP_NCCL_INCLUDE_DIR})
    target_link_libraries(detlogp PUBLIC detlogp::nccl)
    target_compile_definitions(detlogp PUBLIC DETLOGP_WITH_NCCL=1)
  endif()
endif()
message(STATUS "detlogp: NCCL communicator ${DETLOGP_WITH_NCCL} (${DETLOGP_NCCL_LIBRARY})")
