# Requests owned under a lease (issue 38, part "leases"): coordinators
# SIGKILLed mid-stream and restarted on their data directory, workers
# dropping the generations of a coordinator that stopped renewing, job items
# across a restart, expired drains and hung-up Complete calls. Real
# penumbra-worker / penumbra-coordinator processes on loopback
# (models/penumbra-eval on the CPU); one CTest per case.
penumbra_test_executable(leases_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/leases_test.cc
  LIBS penumbra_client nlohmann_json::nlohmann_json)
add_dependencies(leases_test penumbra-worker penumbra-coordinator)
penumbra_gtest_cases(leases_test PREFIX faults_leases_ LABELS "service;faults" TIMEOUT 120)
