# The checkpoint formats (safetensors headers, sharded indexes): pure CPU parsing and serialisation.
target_sources(hbmio PRIVATE src/format/safetensors.cpp src/format/strict_json.cpp)
