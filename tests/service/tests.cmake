# Service integration tests: real penumbra-worker and penumbra-coordinator
# processes on loopback (CPU backend), label `service`. One binary, one CTest
# per case (each starts its own processes on ports the OS picks).
add_executable(service_test ${CMAKE_CURRENT_LIST_DIR}/service_test.cc)
target_link_libraries(service_test PRIVATE penumbra_client penumbra_engine nlohmann_json::nlohmann_json
  PkgConfig::HTTPLIB GTest::gtest GTest::gtest_main penumbra_warnings)
add_dependencies(service_test penumbra-worker penumbra-coordinator)
foreach(case ConcurrentClientsGetTheOfflineAnswers ARequestAdmittedMidDecodeFinishesBeforeAnEarlierLongOne
        RequestsAboutADocumentGoToTheWorkerHoldingIt BadInputIsRefusedAndTheServersKeepServing
        DocumentsTenantsStreamingAndCancel SigtermDrainsRunningRequests)
  add_test(NAME service_${case} COMMAND service_test --gtest_filter=Service.${case}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(service_${case} PROPERTIES LABELS service TIMEOUT 600
    ENVIRONMENT "PENUMBRA_SOURCE_DIR=${PROJECT_SOURCE_DIR};PENUMBRA_TEST_DATA_DIR=${PENUMBRA_TEST_DATA_DIR};PENUMBRA_BIN_DIR=${CMAKE_BINARY_DIR}/bin")
endforeach()
