# Issue 38, "durable": stores that never acknowledge what they did not write.
# Real processes with the coordinator's data directory on a small tmpfs filled
# to ENOSPC (mounting needs root, as in CI; elsewhere the case skips), and a
# delete carried to a worker that was down, and a worker's --prefix-store on a
# full disk. One CTest per case.
penumbra_test_executable(durable_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/durable_test.cc
  LIBS penumbra_client penumbra_engine nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
add_dependencies(durable_test penumbra-worker penumbra-coordinator)
penumbra_gtest_cases(durable_test PREFIX faults_durable_ LABELS "service;faults" TIMEOUT 120)
# The stores' own full-disk tests (unit tests on a small tmpfs) run with the
# fault suite too.
foreach(t document_registry_full_disk_test job_store_full_disk_test segment_store_full_disk_test tombstones_test)
  if(TEST ${t})
    set_property(TEST ${t} APPEND PROPERTY LABELS faults)
  endif()
endforeach()
