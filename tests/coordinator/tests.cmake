penumbra_glob_tests(coordinator LIBS penumbra_tokenizer penumbra_eval penumbra_coordinator penumbra_coordinator_options
  nlohmann_json::nlohmann_json)
# Tests that kill real processes with SIGKILL also carry the label "crash".
if(TEST document_registry_integration_test)
  set_property(TEST document_registry_integration_test APPEND PROPERTY LABELS crash)
endif()
# RocksDB on disk, reopened many times: seconds.
penumbra_cost_label(integration TESTS document_registry_durable_test)
