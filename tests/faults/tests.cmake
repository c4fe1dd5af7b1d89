# Fault tests (issue 38): real processes under full disks, SIGKILLed and
# restarted coordinators, signals, drains and stopped store nodes. Label
# `faults` (run in CI). Each part of the suite keeps its own .cmake file here
# so they can be added and changed independently.
foreach(part durable leases signals store_io)
  if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/${part}.cmake)
    include(${CMAKE_CURRENT_LIST_DIR}/${part}.cmake)
  endif()
endforeach()
