penumbra_glob_tests(worker LIBS penumbra_engine nlohmann_json::nlohmann_json)
