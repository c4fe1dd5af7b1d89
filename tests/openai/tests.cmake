# The OpenAI-compatible API (docs/openai.md): the translation and the chat
# templates in process (label unit), and the official `openai` npm client
# and the docs' curl commands against a real worker and coordinator over TLS
# (labels service;openai; tests/openai/with_service.py starts them).
penumbra_glob_tests(openai LIBS penumbra_openai)
set(_openai_env "${PENUMBRA_TEST_ENV_BIN}")
set(_with_service /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/with_service.py --build ${CMAKE_BINARY_DIR} --)
file(GLOB _openai_node_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/client/*.test.mjs)
foreach(_t ${_openai_node_tests})
  get_filename_component(_name ${_t} NAME_WE)
  # A test that kills the coordinator has it started again on its ports.
  set(_restart "")
  if(_name MATCHES "kill")
    set(_restart --restart-coordinator)
  endif()
  add_test(NAME openai_${_name}
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/with_service.py --build ${CMAKE_BINARY_DIR} ${_restart}
      -- node --test ${_t}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(openai_${_name} PROPERTIES LABELS "service;openai" TIMEOUT 300 ENVIRONMENT "${_openai_env}")
endforeach()
add_test(NAME openai_docs_curl COMMAND ${_with_service} /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/docs_curl_test.py
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(openai_docs_curl PROPERTIES LABELS "service;openai" TIMEOUT 300 ENVIRONMENT "${_openai_env}")
# ops/loadtest.py: HTTP beside Thrift. --api both on a worker and coordinator
# it starts over TLS: phases of the Thrift and the OpenAI-compatible API in
# turn; it fails unless each phase completes a request with no error
# (--require-no-errors) and no client gets stuck. The clients' environment
# defaults (keys, TLS files) are cleared: the run makes its own.
add_test(NAME loadtest_http_vs_thrift
  COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/ops/loadtest.py --start ${PROJECT_SOURCE_DIR}/models/penumbra-eval
    --build ${CMAKE_BINARY_DIR} --tls --api both --clients 2 --seconds 3 --max-new-tokens 8 --ignore-eos
    --grace-seconds 10 --require-no-errors
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set(_loadtest_env "${_openai_env};PENUMBRA_GEN_PY=${CMAKE_BINARY_DIR}/transport/gen-py;PENUMBRA_API_KEY="
  "PENUMBRA_API_KEY_FILE=;PENUMBRA_TLS_CA=;PENUMBRA_TLS_CERT=;PENUMBRA_TLS_KEY=")
set_tests_properties(loadtest_http_vs_thrift PROPERTIES LABELS "service;openai" TIMEOUT 180
  ENVIRONMENT "${_loadtest_env}")
