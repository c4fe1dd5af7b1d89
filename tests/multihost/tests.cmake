# The service across hosts (issue 37), labels `service;multihost`: a coordinator, two
# workers and two value-store nodes, each in a Linux network namespace of its
# own on one bridge, with mutual TLS (tests/multihost/multihost_test.cc).
# Needs root and iproute2; skips itself, with the reason, where network
# namespaces cannot be made.
penumbra_test_executable(multihost_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/multihost_test.cc ${CMAKE_CURRENT_LIST_DIR}/netns_topology.cc
  LIBS penumbra_client penumbra_engine penumbra_tls nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
if(PENUMBRA_SANITIZE AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC 12 misreports std::regex's std::function as maybe uninitialized
  # when the sanitizers instrument it.
  target_compile_options(multihost_test PRIVATE -Wno-maybe-uninitialized)
endif()
add_dependencies(multihost_test penumbra penumbra-worker penumbra-coordinator penumbra-store)
add_test(NAME multihost_test COMMAND multihost_test WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(multihost_test PROPERTIES LABELS "service;multihost" TIMEOUT 600
  SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]"
  ENVIRONMENT "PENUMBRA_SOURCE_DIR=${PROJECT_SOURCE_DIR};PENUMBRA_TEST_DATA_DIR=${PENUMBRA_TEST_DATA_DIR};PENUMBRA_BIN_DIR=${CMAKE_BINARY_DIR}/bin")
# The systemd units of each role (ops/systemd): their settings, and
# `systemd-analyze verify` where systemd is installed (skipped otherwise).
add_test(NAME ops_systemd_units_test COMMAND bash ${PROJECT_SOURCE_DIR}/ops/systemd/verify.sh)
set_tests_properties(ops_systemd_units_test PROPERTIES LABELS "unit;multihost" TIMEOUT 60 SKIP_RETURN_CODE 77)
