# Signals and supervision (issue 38, part "signals"): SIGHUP reloads and
# stops nothing, `penumbra serve` restarts what dies on its old port.
penumbra_test_executable(signals_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/signals_test.cc
  LIBS penumbra_client penumbra_engine penumbra_tenants penumbra_store_node nlohmann_json::nlohmann_json)
add_dependencies(signals_test penumbra penumbra-worker penumbra-coordinator penumbra-store)
penumbra_gtest_cases(signals_test PREFIX faults_signals_ LABELS "service;faults" TIMEOUT 120)
