# Checkpoints (src/checkpoint): load/save of safetensors files and sharded checkpoints, with
# XXH3-64 checksums from libxxhash (linked statically, like liburing).
find_library(XXHASH_STATIC NAMES libxxhash.a REQUIRED)
target_sources(hbmio PRIVATE src/checkpoint/load.cpp src/checkpoint/save.cpp src/checkpoint/integrity.cpp src/checkpoint/opened.cpp
                             src/checkpoint/nccl_load.cpp src/shim/nccl_api.cpp)
target_link_libraries(hbmio PRIVATE ${XXHASH_STATIC})
if(TARGET hbmio_cli)
  target_sources(hbmio_cli PRIVATE tools/hbmio/ckpt.cpp)
endif()
