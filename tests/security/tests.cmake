# Security tests (issue 37): each attack on a plane is refused and the
# process keeps serving. Every tests/security/*_test.cc is one binary whose
# cases are each a CTest of their own (penumbra_gtest_cases, labels
# `service;security`), running real processes on loopback (the service's binaries
# from ${CMAKE_BINARY_DIR}/bin) or real servers in-process; adding a test
# needs no edit here.
file(GLOB _security_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*_test.cc)
foreach(src ${_security_tests})
  get_filename_component(name ${src} NAME_WE)
  penumbra_test_executable(${name} SOURCES ${src}
    LIBS penumbra_client penumbra_engine penumbra_store_node penumbra_ucx penumbra_collective penumbra_metrics
      penumbra_tls nlohmann_json::nlohmann_json PkgConfig::HTTPLIB)
  add_dependencies(${name} penumbra penumbra-worker penumbra-coordinator penumbra-store)
  penumbra_gtest_cases(${name} PREFIX "${name}." WITH_SUITE LABELS "service;security" TIMEOUT 600)
endforeach()
