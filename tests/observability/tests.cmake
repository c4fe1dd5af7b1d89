# Observability: a real Prometheus (Debian's `prometheus`, installed by
# ops/setup.sh) scrapes a worker's and a coordinator's /metrics on loopback,
# and the Grafana dashboard's queries (ops/grafana/penumbra.json) run in it
# (label prometheus; tests/openai/with_service.py starts the service).
add_test(NAME prometheus_scrape
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/../openai/with_service.py --build ${CMAKE_BINARY_DIR} --
          /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/prometheus_test.py
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(prometheus_scrape PROPERTIES LABELS "service;prometheus" TIMEOUT 300)
