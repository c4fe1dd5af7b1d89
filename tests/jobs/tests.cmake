penumbra_glob_tests(jobs LIBS penumbra_jobs)
# Tests that kill real processes with SIGKILL also carry the label "crash".
if(TEST job_store_integration_test)
  set_property(TEST job_store_integration_test APPEND PROPERTY LABELS crash)
endif()
# RocksDB on disk, reopened many times: seconds.
penumbra_cost_label(integration TESTS job_store_test)
if(TEST file_store_test)
  set_property(TEST file_store_test APPEND PROPERTY LABELS crash)
endif()
penumbra_cost_label(integration TESTS file_store_test)
