# The public headers (include/hbmio): each compiles on its own, with nothing on the include path
# but include/ and no flag of the library's own build (a user's translation unit), and twice in a
# row (its include guard); and hbmio/hbmio.hpp, "include this one header", includes every header
# of include/hbmio (the test below). A header added later is picked up by the glob.
# include()d from tests/CMakeLists.txt.
file(GLOB _hbmio_public_headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include
     ${PROJECT_SOURCE_DIR}/include/hbmio/*.hpp ${PROJECT_SOURCE_DIR}/include/hbmio/*/*.hpp)
set(_hbmio_header_sources)
foreach(header IN LISTS _hbmio_public_headers)
  string(MAKE_C_IDENTIFIER ${header} name)
  set(source ${CMAKE_CURRENT_BINARY_DIR}/public_headers/${name}.cpp)
  # Written only when changed, so a configure does not rebuild them.
  file(CONFIGURE OUTPUT ${source} CONTENT "#include \"${header}\"\n#include \"${header}\"\n" @ONLY)
  list(APPEND _hbmio_header_sources ${source})
endforeach()
# Compiled only: an OBJECT library that nothing links, built with every target.
add_library(public_headers OBJECT ${_hbmio_header_sources})
target_include_directories(public_headers PRIVATE ${PROJECT_SOURCE_DIR}/include)
target_compile_features(public_headers PRIVATE cxx_std_20)
target_compile_options(public_headers PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Werror)

add_test(NAME public_headers
         COMMAND ${CMAKE_COMMAND} -DINCLUDE_DIR=${PROJECT_SOURCE_DIR}/include -P ${CMAKE_CURRENT_SOURCE_DIR}/public_headers_test.cmake)
unset(_hbmio_public_headers)
unset(_hbmio_header_sources)
