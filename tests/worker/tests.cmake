penumbra_glob_tests(worker LIBS penumbra_engine penumbra_service penumbra_shadowkv_check penumbra_kernel_trace
  penumbra_worker_options nlohmann_json::nlohmann_json)
# Whole generations on the stories model, many of them: tens of seconds.
penumbra_cost_label(integration TESTS prefix_reuse_test scheduler_test context_parallel_test)
# bench_modes_gpu_test runs the penumbra-bench built beside it.
if(TARGET bench_modes_gpu_test)
  add_dependencies(bench_modes_gpu_test penumbra-bench)
endif()
