penumbra_glob_tests(storage LIBS penumbra_storage)
# Tests that kill real processes with SIGKILL also carry the label "crash".
if(TEST segment_store_integration_test)
  set_property(TEST segment_store_integration_test APPEND PROPERTY LABELS crash)
endif()
# RocksDB on disk, many writes: well over the seconds `unit` allows.
penumbra_cost_label(integration TESTS segment_store_test)
