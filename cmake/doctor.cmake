# hbmio doctor: read-only probes of sysfs/procfs/cufile.json (src/doctor) and the `doctor` subcommand.
target_sources(hbmio PRIVATE
  src/doctor/pci.cpp
  src/doctor/gpu.cpp
  src/doctor/storage.cpp
  src/doctor/fabric.cpp
  src/doctor/topology.cpp
  src/doctor/gds.cpp
  src/doctor/doctor.cpp
)
if(TARGET hbmio_cli)
  target_sources(hbmio_cli PRIVATE tools/hbmio/doctor.cpp)
endif()
