# A store node stopped (SIGSTOP) under a worker reading and writing documents
# on it: the other requests keep their decode rate, the ones that need the
# node fall back to prefill within the deadline, the node's circuit breaker
# opens and closes again (tests/faults/store_io_test.cc). Real processes.
penumbra_test_executable(store_io_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/store_io_test.cc
  LIBS penumbra_client penumbra_engine nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
add_dependencies(store_io_test penumbra-worker penumbra-store)
penumbra_gtest_cases(store_io_test PREFIX faults_store_io_ LABELS "service;faults" TIMEOUT 120)
# RUN_SERIAL: it compares token rates, which another test sharing the
# machine's cores (ctest -j) would swing by 2x between windows.
set_property(TEST faults_store_io_AStoppedStoreNodeCostsOnlyTheRequestsThatNeedIt PROPERTY RUN_SERIAL TRUE)
