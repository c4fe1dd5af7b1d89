# The value-store node (store_node/): penumbra-store processes reached over UCX
# by workers, killed and restarted. Real processes: label "distributed".
penumbra_glob_tests(store_node LIBS penumbra_transport penumbra_ucx penumbra_store_node penumbra_engine
  nlohmann_json::nlohmann_json)
if(TEST store_node_integration_test)
  set_property(TEST store_node_integration_test APPEND PROPERTY LABELS distributed)
endif()
if(TARGET store_node_integration_test)
  add_dependencies(store_node_integration_test penumbra-store)
endif()
