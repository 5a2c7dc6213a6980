# Locates libtorch inside the PyTorch wheel (by default the one in .venv/) and defines
#   dtrain::torch       - headers and CPU libraries (libtorch, libtorch_cpu, libc10)
#   dtrain::torch_cuda  - CUDA libraries of the same wheel and the CUDA runtime it loads
#   dtrain::nccl        - the NCCL that torch itself loads (the nvidia-nccl wheel), never a second copy
#
# Why not find_package(Torch)? TorchConfig.cmake insists on a CUDA toolchain for a CUDA
# wheel even when we build CPU-only, configures nvcc flags we do not use, and resolves NVRTC
# from the system toolkit. We only need headers and shared libraries, so we import them.
#
# Inputs (cache): DTRAIN_PYTHON (interpreter that has torch), TORCH_ROOT (the torch package dir).
# Outputs: TORCH_ROOT, TORCH_VERSION, DTRAIN_TORCH_HAS_CUDA, DTRAIN_NCCL_ROOT, DTRAIN_NCCL_VERSION.
#
# Installed dtrain's package config includes this file too, with DTRAIN_PACKAGE_CONSUMER set and
# TORCH_ROOT baked in. Projects that use dtrain only need the CUDA toolkit to compile CUDA code
# of their own, so there it is optional: the wheel ships the CUDA runtime and its headers.

if(NOT DTRAIN_PYTHON AND NOT (DTRAIN_PACKAGE_CONSUMER AND TORCH_ROOT))
  if(EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    set(DTRAIN_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH "Python with torch")
  else()
    find_program(DTRAIN_PYTHON NAMES python3 python)
  endif()
endif()
if(NOT TORCH_ROOT)
  execute_process(
    COMMAND "${DTRAIN_PYTHON}" -c "import os,torch;print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE _torch_root OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0 OR NOT _torch_root)
    message(FATAL_ERROR
      "dtrain: could not find PyTorch with '${DTRAIN_PYTHON}'. Run 'bash cluster/setup.sh' "
      "(installs torch into .venv/), or pass -DTORCH_ROOT=/path/to/site-packages/torch.")
  endif()
  set(TORCH_ROOT "${_torch_root}" CACHE PATH "torch package directory (libtorch inside the wheel)")
endif()

if(NOT EXISTS "${TORCH_ROOT}/lib/libtorch.so" OR NOT EXISTS "${TORCH_ROOT}/include/ATen/ATen.h")
  message(FATAL_ERROR "dtrain: ${TORCH_ROOT} does not look like a torch package (no lib/libtorch.so or "
    "include/ATen); pass -DTORCH_ROOT=/path/to/site-packages/torch")
endif()

file(STRINGS "${TORCH_ROOT}/version.py" _torch_ver_line REGEX "^__version__")
string(REGEX REPLACE ".*'([^']+)'.*" "\\1" TORCH_VERSION "${_torch_ver_line}")
message(STATUS "dtrain: torch ${TORCH_VERSION} at ${TORCH_ROOT}")

if(TARGET dtrain::torch)
  return()
endif()
add_library(dtrain::torch INTERFACE IMPORTED GLOBAL)
target_include_directories(dtrain::torch SYSTEM INTERFACE
  "${TORCH_ROOT}/include" "${TORCH_ROOT}/include/torch/csrc/api/include")
target_link_libraries(dtrain::torch INTERFACE
  "${TORCH_ROOT}/lib/libtorch.so" "${TORCH_ROOT}/lib/libtorch_cpu.so" "${TORCH_ROOT}/lib/libc10.so")
target_compile_definitions(dtrain::torch INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
if(DTRAIN_PACKAGE_CONSUMER)
  # libtorch's headers need C++17; older compilers default to C++14.
  target_compile_features(dtrain::torch INTERFACE cxx_std_17)
endif()
# The wheel's libraries find their CUDA/NCCL neighbours through their own RUNPATH; ours point
# at torch/lib so programs run from build/bin without LD_LIBRARY_PATH.
set(DTRAIN_TORCH_LIBDIR "${TORCH_ROOT}/lib")

set(DTRAIN_TORCH_HAS_CUDA OFF)
if(EXISTS "${TORCH_ROOT}/lib/libtorch_cuda.so")
  set(DTRAIN_TORCH_HAS_CUDA ON)
endif()

get_filename_component(_site "${TORCH_ROOT}" DIRECTORY)
if(DTRAIN_TORCH_HAS_CUDA AND DTRAIN_WITH_CUDA)
  if(DTRAIN_PACKAGE_CONSUMER)
    find_package(CUDAToolkit QUIET)
  else()
    find_package(CUDAToolkit REQUIRED)
  endif()
  # Link the CUDA runtime the wheel ships (the one libc10_cuda loads) when present.
  set(_cudart "${_site}/nvidia/cu13/lib/libcudart.so.13")
  if(NOT EXISTS "${_cudart}")
    file(GLOB _cudart "${_site}/nvidia/cuda_runtime/lib/libcudart.so.*")
  endif()
  if(_cudart)
    list(GET _cudart 0 _cudart_include)
    get_filename_component(_cudart_include "${_cudart_include}" DIRECTORY)
    get_filename_component(_cudart_include "${_cudart_include}/../include" ABSOLUTE)
  elseif(TARGET CUDA::cudart)
    set(_cudart CUDA::cudart)
  else()
    message(FATAL_ERROR "dtrain: the torch wheel at ${_site} has no CUDA runtime (nvidia/*/lib/libcudart.so.*) "
      "and there is no CUDA toolkit; install the nvidia-cuda-runtime wheel torch depends on")
  endif()
  add_library(dtrain::torch_cuda INTERFACE IMPORTED GLOBAL)
  # libtorch_cuda registers the CUDA kernels when it is loaded, while our code calls few of its
  # symbols: under --as-needed (the default of Ubuntu's GCC) the linker would drop it and
  # at::hasCUDA() would be false. As torch's own CMake config does, keep it needed.
  target_link_libraries(dtrain::torch_cuda INTERFACE dtrain::torch
    "-Wl,--no-as-needed,${TORCH_ROOT}/lib/libtorch_cuda.so,--as-needed"
    "${TORCH_ROOT}/lib/libc10_cuda.so" ${_cudart})
  if(CUDAToolkit_FOUND)
    target_include_directories(dtrain::torch_cuda SYSTEM INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
  elseif(EXISTS "${_cudart_include}/cuda_runtime_api.h")
    # Only reached by consumers: the headers of the runtime torch loads, for code that includes
    # c10/cuda or cuda_runtime_api.h.
    target_include_directories(dtrain::torch_cuda SYSTEM INTERFACE "${_cudart_include}")
    message(STATUS "dtrain: no CUDA toolkit; dtrain::torch_cuda uses the CUDA runtime of the torch wheel (${_cudart})")
  else()
    message(STATUS "dtrain: no CUDA toolkit; dtrain::torch_cuda links the CUDA runtime of the torch wheel (${_cudart}), no CUDA headers")
  endif()
  list(APPEND DTRAIN_TORCH_LIBDIR "${_site}/nvidia/cu13/lib")

  if(DTRAIN_WITH_NCCL)
    find_path(DTRAIN_NCCL_INCLUDE nccl.h PATHS "${_site}/nvidia/nccl/include" NO_DEFAULT_PATH)
    find_file(DTRAIN_NCCL_LIB NAMES libnccl.so.2 libnccl.so PATHS "${_site}/nvidia/nccl/lib" NO_DEFAULT_PATH)
    if(DTRAIN_NCCL_INCLUDE AND DTRAIN_NCCL_LIB)
      file(STRINGS "${DTRAIN_NCCL_INCLUDE}/nccl.h" _nv REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
             DTRAIN_NCCL_VERSION "${_nv}")
      add_library(dtrain::nccl INTERFACE IMPORTED GLOBAL)
      target_include_directories(dtrain::nccl SYSTEM INTERFACE "${DTRAIN_NCCL_INCLUDE}")
      target_link_libraries(dtrain::nccl INTERFACE "${DTRAIN_NCCL_LIB}")
      get_filename_component(_nccl_dir "${DTRAIN_NCCL_LIB}" DIRECTORY)
      list(APPEND DTRAIN_TORCH_LIBDIR "${_nccl_dir}")
      message(STATUS "dtrain: NCCL ${DTRAIN_NCCL_VERSION} from the torch wheel (${DTRAIN_NCCL_LIB})")
    else()
      message(WARNING "dtrain: DTRAIN_WITH_NCCL=ON but the nvidia-nccl wheel next to torch was not found; building without NCCL")
      set(DTRAIN_WITH_NCCL OFF)
    endif()
  endif()
else()
  set(DTRAIN_WITH_CUDA OFF)
  set(DTRAIN_WITH_NCCL OFF)
endif()
