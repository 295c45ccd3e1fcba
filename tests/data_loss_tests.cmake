# The CLI data-loss regression tests (Ctrl-C during sharded and single-file saves, verify and
# load racing replacements, checksum of a shrinking file, FIFO and device-node targets, overwrite
# refusal); include()d from tests/CMakeLists.txt.
if(HBMIO_BUILD_TOOLS)
  add_test(NAME data_loss COMMAND ${CMAKE_CURRENT_LIST_DIR}/data_loss_test.sh $<TARGET_FILE:hbmio_cli>)
  set_tests_properties(data_loss PROPERTIES ENVIRONMENT "HBMIO_TEST_DIR=${CMAKE_CURRENT_BINARY_DIR}" TIMEOUT 600)
endif()
