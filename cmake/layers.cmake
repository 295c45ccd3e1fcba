# The layers of src/ as build targets. Each layer is an OBJECT library whose only view of src/ is
# a folder of links, made here, to itself and the layers it may use; an include that crosses a
# layer the wrong way ("io/..." from the doctor is fine, "doctor/..." from io is not) then fails to
# compile with "No such file or directory" instead of waiting for a review. The same table is
# written to ${PROJECT_BINARY_DIR}/layers.txt, one "<name> <layers it may include>" line per layer,
# for tests/layers_test.sh to check what a compiler never sees (headers no source includes, a
# folder of src/ that is no layer, the public headers and the faces). The static library hbmio is
# the union of the layers' objects, so users still link one archive.
#
#   hbmio_layer(<name> [TESTING] SEES <layers it may include> SOURCES <files under src/<name>>)
#
# TESTING: test support (fault injection), a static library of its own that only tests link, never
# part of hbmio.

set(HBMIO_LAYER_ROOTS ${PROJECT_BINARY_DIR}/layers)
set(HBMIO_LAYER_TABLE ${PROJECT_BINARY_DIR}/layers.txt)
file(WRITE ${HBMIO_LAYER_TABLE} "")

# What every layer compiles with: warnings, the version, the CUDA switch, and the include roots of
# the libraries used in headers (fmt, nlohmann-json, liburing, the CUDA runtime).
add_library(hbmio_layer_flags INTERFACE)
target_compile_features(hbmio_layer_flags INTERFACE cxx_std_20)
target_include_directories(hbmio_layer_flags INTERFACE ${PROJECT_SOURCE_DIR}/include ${LIBURING_INCLUDE_DIRS} ${CURL_HEADER_DIR})
target_compile_options(hbmio_layer_flags INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
                                                   -Wno-missing-field-initializers)  # designated initializers leave fields defaulted on purpose
target_compile_definitions(hbmio_layer_flags INTERFACE HBMIO_VERSION="${PROJECT_VERSION}" HBMIO_BUILDING)
target_link_libraries(hbmio_layer_flags INTERFACE fmt::fmt-header-only nlohmann_json::nlohmann_json)
if(HBMIO_HAVE_CUDA)
  target_compile_definitions(hbmio_layer_flags INTERFACE HBMIO_HAVE_CUDA=1)
  target_include_directories(hbmio_layer_flags INTERFACE ${CUDAToolkit_INCLUDE_DIRS})
endif()

function(hbmio_layer name)
  cmake_parse_arguments(PARSE_ARGV 1 L "TESTING" "" "SEES;SOURCES")
  set(root ${HBMIO_LAYER_ROOTS}/${name})
  # Made again at every configure, so a layer dropped from SEES disappears from the root.
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root})
  foreach(seen IN ITEMS ${name} ${L_SEES})
    if(NOT IS_DIRECTORY ${PROJECT_SOURCE_DIR}/src/${seen})
      message(FATAL_ERROR "hbmio_layer(${name}): no layer src/${seen}")
    endif()
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${seen} ${root}/${seen} SYMBOLIC)
  endforeach()
  list(JOIN L_SEES " " sees)
  file(APPEND ${HBMIO_LAYER_TABLE} "${name} ${sees}\n")
  list(TRANSFORM L_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/src/${name}/)
  if(L_TESTING)
    add_library(hbmio_${name} STATIC ${L_SOURCES})
    target_link_libraries(hbmio_${name} PUBLIC hbmio)
  else()
    add_library(hbmio_${name} OBJECT ${L_SOURCES})
    target_sources(hbmio PRIVATE $<TARGET_OBJECTS:hbmio_${name}>)
  endif()
  target_include_directories(hbmio_${name} PRIVATE ${root})
  target_link_libraries(hbmio_${name} PRIVATE hbmio_layer_flags)
  # (HBMIO_UNITY_BUILD: names a source file keeps to itself go in an anonymous namespace, and no
  # two files of one layer may give one name two meanings.)
  # GCC's -Wsubobject-linkage is about classes defined in headers; a batch includes .cpp files,
  # whose classes may hold types of their own anonymous namespace.
  set_target_properties(hbmio_${name} PROPERTIES UNITY_BUILD ${HBMIO_UNITY_BUILD} UNITY_BUILD_BATCH_SIZE 8)
  if(HBMIO_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(hbmio_${name} PRIVATE -Wno-subobject-linkage)
  endif()
endfunction()
