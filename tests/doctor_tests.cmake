# hbmio doctor: unit tests on recorded sysfs trees (../shared/fixtures) and constructed ones, plus
# the command line. Fixture-based tests skip, naming the missing archive, when HBMIO_FIXTURES
# does not exist. Captures of the project's own machines (scripts/capture-sysfs.sh) live in
# tests/data/doctor and are always there.
set(HBMIO_FIXTURES "${PROJECT_SOURCE_DIR}/../shared/fixtures" CACHE PATH "Recorded test fixtures (sysfs trees)")

add_executable(doctor_tests doctor_test.cpp)
target_link_libraries(doctor_tests PRIVATE hbmio GTest::gtest_main fmt::fmt-header-only nlohmann_json::nlohmann_json)
target_include_directories(doctor_tests PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_definitions(doctor_tests PRIVATE HBMIO_FIXTURES="${HBMIO_FIXTURES}" HBMIO_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data")
add_test(NAME doctor COMMAND doctor_tests)
set_tests_properties(doctor PROPERTIES ENVIRONMENT "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}")

if(TARGET hbmio_cli)
  add_test(NAME doctor_cli COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/doctor_cli_test.sh $<TARGET_FILE:hbmio_cli> ${HBMIO_FIXTURES})
  set_tests_properties(doctor_cli PROPERTIES ENVIRONMENT "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}")
endif()

if(TARGET hbmio_cli)
  # The doctor's cuFile verdict against the cufile backend's behaviour, live.
  add_test(NAME doctor_live COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/doctor_live_test.sh $<TARGET_FILE:hbmio_cli>)
  set_tests_properties(doctor_live PROPERTIES ENVIRONMENT "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}")
endif()
