# Service integration tests: real penumbra-worker and penumbra-coordinator
# processes on loopback (CPU backend), label `service`. One binary, one CTest
# per case, found in the source (each starts its own processes on ports the OS picks).
penumbra_test_executable(service_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/service_test.cc
  LIBS penumbra_client penumbra_engine nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
add_dependencies(service_test penumbra-worker penumbra-coordinator penumbra-store)
penumbra_gtest_cases(service_test PREFIX service_ LABELS service TIMEOUT 600)
set_property(TEST service_ALostWorkersDocumentsComeBackFromTheStoreNode service_AWorkerLostMidGenerationIsResumedOnAnother
  service_DrainingAWorkerLosesNoRequest service_TwoStoreNodesAndTwoWorkersSurviveKills APPEND PROPERTY LABELS distributed)

# Context groups inside the service (worker processes started with --group,
# formed by the coordinator): labels service and distributed.
penumbra_test_executable(group_service_test SOURCES ${CMAKE_CURRENT_LIST_DIR}/group_service_test.cc
  LIBS penumbra_client penumbra_engine nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
add_dependencies(group_service_test penumbra-worker penumbra-coordinator)
penumbra_gtest_cases(group_service_test PREFIX group_ LABELS "service;distributed" TIMEOUT 600)

# `penumbra serve` with a group of two ranks over mutual TLS.
add_test(NAME group_serve COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/serve_group_test.sh ${CMAKE_BINARY_DIR}/bin
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(group_serve PROPERTIES LABELS "service;distributed" TIMEOUT 300)

# penumbra serve + penumbra-service-bench at a small size (the GPU
# measurement's tool, kept working on the CPU).
add_test(NAME service_bench_cpu COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/service_bench_test.sh ${CMAKE_BINARY_DIR}/bin
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(service_bench_cpu PROPERTIES LABELS service TIMEOUT 300)
# The Python client (coordinator/client/python) against real processes.
add_test(NAME service_python_client
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/python_client_test.py --build ${CMAKE_BINARY_DIR}
    --model ${PROJECT_SOURCE_DIR}/models/penumbra-eval
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(service_python_client PROPERTIES LABELS service TIMEOUT 600
  ENVIRONMENT "PENUMBRA_GEN_PY=${CMAKE_BINARY_DIR}/transport/gen-py")
# `penumbra job` (batch jobs through the CLI) against `penumbra serve` with a
# data_dir: tests/service/job_cli_test.sh.
add_test(NAME service_job_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/job_cli_test.sh ${CMAKE_BINARY_DIR}/bin
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(service_job_cli PROPERTIES LABELS service TIMEOUT 180)
# Real processes killed with SIGKILL during a batch job, and the tenants'
# isolation and quotas, also carry the labels of issue 19.
set_property(TEST service_BatchJobChaosKillsCoordinatorAndWorkers service_BatchJobsSurviveCoordinatorKillsAndAnswerEachItemOnce
  APPEND PROPERTY LABELS chaos)
set_property(TEST service_TenantQuotasRefuseWithRetryAfterAndIsolate APPEND PROPERTY LABELS tenants)
