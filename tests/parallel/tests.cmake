# worker/parallel/: the context-parallel process groups (TCP on loopback;
# NCCL on 2 GPUs) and one sequence split over ranks. Tests that start real
# processes carry the label "distributed".
penumbra_glob_tests(parallel LIBS penumbra_transport penumbra_collective penumbra_engine penumbra_service
                    nlohmann_json::nlohmann_json)
foreach(t collective_test context_parallel_integration_test group_steps_test)
  if(TEST ${t})
    set_property(TEST ${t} APPEND PROPERTY LABELS distributed)
  endif()
endforeach()
# Real processes: collective_test forks a process per rank for many groups
# over TCP (over a minute).
penumbra_cost_label(service TESTS collective_test)
# Context groups of threads over TCP under the scheduler's steps, with
# persistent tiers in files (~20 s).
penumbra_cost_label(integration TESTS group_steps_test)
# Context parallel: two `penumbra generate` ranks against one process.
if(TARGET context_parallel_integration_test)
  add_dependencies(context_parallel_integration_test penumbra)
endif()
