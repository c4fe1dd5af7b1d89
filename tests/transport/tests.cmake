# The UCX data plane and value-store nodes (UCX over TCP and shared memory on
# loopback), the context-parallel process groups (TCP on loopback; NCCL on 2
# GPUs). Tests that start real processes carry the label "distributed".
penumbra_glob_tests(transport LIBS penumbra_transport penumbra_ucx penumbra_store_node penumbra_collective penumbra_engine
  nlohmann_json::nlohmann_json)
foreach(t ucx_rpc_test store_node_integration_test collective_test context_parallel_integration_test)
  if(TEST ${t})
    set_property(TEST ${t} APPEND PROPERTY LABELS distributed)
  endif()
endforeach()
# Real processes: collective_test forks a process per rank for many groups
# over TCP (over a minute); ucx_rpc_test kills a server in a child process.
penumbra_cost_label(service TESTS collective_test ucx_rpc_test)
# Real Thrift servers with timeouts of seconds (idle, handshake deadlines).
penumbra_cost_label(integration TESTS thrift_server_test)
if(TARGET store_node_integration_test)
  add_dependencies(store_node_integration_test penumbra-store)
endif()
# Context parallel: two `penumbra generate` ranks against one process.
if(TARGET context_parallel_integration_test)
  add_dependencies(context_parallel_integration_test penumbra)
endif()
