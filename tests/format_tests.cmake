# The safetensors format layer: conformance with the reference's fixtures, every bad-input rule,
# byte identity with the reference writer, and a replay of the fuzz corpus and regressions.
if(NOT DEFINED HBMIO_FIXTURES)
  set(HBMIO_FIXTURES "${PROJECT_SOURCE_DIR}/../shared/fixtures" CACHE PATH "Directory holding the reference fixtures (safetensors/...)")
endif()

add_executable(format_tests format_test.cpp fuzz_replay_test.cpp
               ${PROJECT_SOURCE_DIR}/fuzz/safetensors_header_fuzzer.cpp ${PROJECT_SOURCE_DIR}/fuzz/index_fuzzer.cpp)
target_link_libraries(format_tests PRIVATE hbmio GTest::gtest_main nlohmann_json::nlohmann_json)
target_include_directories(format_tests PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/fuzz)
# The fuzz targets without their libFuzzer entry points: the replay test calls them directly.
target_compile_definitions(format_tests PRIVATE HBMIO_FUZZ_NO_MAIN=1 HBMIO_SOURCE_FUZZ_DIR="${PROJECT_SOURCE_DIR}/fuzz")

add_test(NAME format COMMAND format_tests --gtest_filter=-FuzzReplay*)
add_test(NAME fuzz_replay COMMAND format_tests --gtest_filter=FuzzReplay*)
set_tests_properties(format fuzz_replay PROPERTIES ENVIRONMENT
  "HBMIO_FIXTURES=${HBMIO_FIXTURES};HBMIO_FUZZ_DIR=${PROJECT_SOURCE_DIR}/fuzz;HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}")
