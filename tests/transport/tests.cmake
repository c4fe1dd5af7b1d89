# The wire and RPC helpers: Thrift servers, TLS-independent framing, the UCX
# data plane (UCX over TCP and shared memory on loopback) and its frames, the
# circuit breaker. Tests that start real processes carry the label
# "distributed".
penumbra_glob_tests(transport LIBS penumbra_transport penumbra_ucx nlohmann_json::nlohmann_json)
if(TEST ucx_rpc_test)
  set_property(TEST ucx_rpc_test APPEND PROPERTY LABELS distributed)
endif()
# Real processes: ucx_rpc_test kills a server in a child process.
penumbra_cost_label(service TESTS ucx_rpc_test)
# Real Thrift servers with timeouts of seconds (idle, handshake deadlines).
penumbra_cost_label(integration TESTS thrift_server_test)
