# Loads and verifies racing replacements of the checkpoint they read, and a many-shard load under
# a low open-file limit; include()d from tests/CMakeLists.txt.
add_executable(replace_race_tests ${CMAKE_CURRENT_LIST_DIR}/replace_race_test.cpp)
target_link_libraries(replace_race_tests PRIVATE hbmio GTest::gtest_main fmt::fmt-header-only)
target_include_directories(replace_race_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
add_test(NAME replace_race COMMAND replace_race_tests)
set_tests_properties(replace_race PROPERTIES ENVIRONMENT "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}" TIMEOUT 300)
