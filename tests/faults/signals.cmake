# Signals and supervision (issue 38, part "signals"): SIGHUP reloads and
# stops nothing, `penumbra serve` restarts what dies on its old port.
add_executable(signals_test ${CMAKE_CURRENT_LIST_DIR}/signals_test.cc)
target_link_libraries(signals_test PRIVATE penumbra_client penumbra_engine penumbra_tenants penumbra_store_node nlohmann_json::nlohmann_json
  GTest::gtest GTest::gtest_main penumbra_warnings)
add_dependencies(signals_test penumbra penumbra-worker penumbra-coordinator penumbra-store)
foreach(case SighupReloadsALoneCoordinatorWorkerAndStoreNodeAndStopsNothing SighupRereadsThePlainApiKeys
        ServePassesSighupOnAndRestartsKilledChildrenOnTheirPorts
        ServeKeepsRestartingAChildThatKeepsDyingWithACappedBackoff)
  add_test(NAME faults_signals_${case} COMMAND signals_test --gtest_filter=Signals.${case}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(faults_signals_${case} PROPERTIES LABELS faults TIMEOUT 120
    ENVIRONMENT "PENUMBRA_SOURCE_DIR=${PROJECT_SOURCE_DIR};PENUMBRA_TEST_DATA_DIR=${PENUMBRA_TEST_DATA_DIR};PENUMBRA_BIN_DIR=${CMAKE_BINARY_DIR}/bin")
endforeach()
