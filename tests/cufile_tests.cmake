# Tests of the cufile backend and its libcufile shim; include()d from tests/CMakeLists.txt, where
# the targets hbmio and GTest::gtest_main exist. Targets are defined directly (no helper).
#
# ctest entries (all match `ctest -R cufile`):
#   cufile                      shim, error table, probe, no-GPU behaviour; runs anywhere
#   cufile_env_override         the probe with HBMIO_CUFILE_LIBRARY pointing nowhere (own process:
#                               the library is loaded once per process)
#   cufile_gpu                  label gpu; skips without a CUDA device
#   cufile_gpu_experimental_fs  label gpu; the same with CUFILE_EXPERIMENTAL_FS=1, which lets
#                               libcufile register files on hosts without a udev database
#                               (see diagnose_handle_not_registered in src/io/cufile_engine.cpp)
#   cufile_abi                  compile-time ABI check against the real cufile.h, where one exists

# The nvidia-cufile wheel (pip), if any: a cufile.h for the ABI test and a libcufile to load on
# machines without a CUDA toolkit. Its directory is nvidia/<cuXX>/ with include/ and lib/.
# HBMIO_CUFILE_WHEEL (environment): that directory, as scripts/test-env.sh installs the pinned wheel
# beside the test venv (torch's CUDA dependencies pin another nvidia-cufile inside it).
set(_hbmio_cufile_wheel "$ENV{HBMIO_CUFILE_WHEEL}")
find_package(Python3 COMPONENTS Interpreter QUIET)
if(NOT _hbmio_cufile_wheel AND Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
            "import glob, os, nvidia\nfor d in sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], '*'))):\n    if os.path.exists(os.path.join(d, 'include', 'cufile.h')):\n        print(d, end='')\n        break"
    OUTPUT_VARIABLE _hbmio_cufile_wheel
    ERROR_QUIET)
endif()

set(_hbmio_cufile_test_env "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}")
if(_hbmio_cufile_wheel AND EXISTS "${_hbmio_cufile_wheel}/lib/libcufile.so.0")
  list(APPEND _hbmio_cufile_test_env "HBMIO_TEST_CUFILE_LIBRARY=${_hbmio_cufile_wheel}/lib/libcufile.so.0")
endif()

add_executable(cufile_tests ${CMAKE_CURRENT_LIST_DIR}/cufile_tests.cpp)
target_link_libraries(cufile_tests PRIVATE hbmio hbmio_testing GTest::gtest_main ${CMAKE_DL_LIBS})
target_include_directories(cufile_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(cufile_tests PRIVATE -Wall -Wextra)
# fmt as the library's layers use it (header-only): the src/ headers this test includes use fmt, and
# without it a call the optimiser keeps into fmt's compiled part (a Release build keeps one) is
# left undefined at link time.
target_link_libraries(cufile_tests PRIVATE fmt::fmt-header-only)

add_test(NAME cufile COMMAND cufile_tests --gtest_filter=-CufileGpu.*:CufileEnv.*)
add_test(NAME cufile_env_override COMMAND cufile_tests --gtest_filter=CufileEnv.*)
add_test(NAME cufile_gpu COMMAND cufile_tests --gtest_filter=CufileGpu.*)
add_test(NAME cufile_gpu_experimental_fs COMMAND cufile_tests --gtest_filter=CufileGpu.*)
set_tests_properties(cufile cufile_gpu PROPERTIES ENVIRONMENT "${_hbmio_cufile_test_env}")
set_tests_properties(cufile_env_override PROPERTIES
  ENVIRONMENT "${_hbmio_cufile_test_env};HBMIO_CUFILE_LIBRARY=/nonexistent/hbmio-test/libcufile.so.0")
set_tests_properties(cufile_gpu_experimental_fs PROPERTIES ENVIRONMENT "${_hbmio_cufile_test_env};CUFILE_EXPERIMENTAL_FS=1")
set_tests_properties(cufile_gpu cufile_gpu_experimental_fs PROPERTIES LABELS gpu)

# The ABI test needs the real cufile.h (and the cuda.h it includes). Its include directories are
# PRIVATE to this one target: no other target must see NVIDIA's declarations next to the shim's.
set(_hbmio_cufile_header_hints /usr/local/cuda/targets/x86_64-linux/include /usr/local/cuda/include)
if(CUDAToolkit_INCLUDE_DIRS)
  list(PREPEND _hbmio_cufile_header_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()
if(_hbmio_cufile_wheel)
  list(APPEND _hbmio_cufile_header_hints "${_hbmio_cufile_wheel}/include")
endif()
find_path(HBMIO_CUFILE_H_DIR cufile.h HINTS ${_hbmio_cufile_header_hints} DOC "directory of the real cufile.h (ABI test only)")
find_path(HBMIO_CUDA_H_DIR cuda.h HINTS ${_hbmio_cufile_header_hints} DOC "directory of cuda.h (ABI test only)")
if(HBMIO_CUFILE_H_DIR AND HBMIO_CUDA_H_DIR)
  message(STATUS "hbmio: cuFile ABI test against ${HBMIO_CUFILE_H_DIR}/cufile.h")
  add_executable(cufile_abi_test ${CMAKE_CURRENT_LIST_DIR}/cufile_abi_test.cpp)
  # hbmio for the error-name table that main() compares with the header's list.
  target_link_libraries(cufile_abi_test PRIVATE hbmio)
  target_include_directories(cufile_abi_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${HBMIO_CUFILE_H_DIR} ${HBMIO_CUDA_H_DIR})
  add_test(NAME cufile_abi COMMAND cufile_abi_test)
else()
  message(STATUS "hbmio: no cufile.h found (CUDA toolkit or nvidia-cufile wheel): cuFile ABI test not built")
endif()

unset(_hbmio_cufile_wheel)
unset(_hbmio_cufile_test_env)
unset(_hbmio_cufile_header_hints)
