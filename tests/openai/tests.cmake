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
  add_test(NAME openai_${_name} COMMAND ${_with_service} node --test ${_t} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(openai_${_name} PROPERTIES LABELS "service;openai" TIMEOUT 300 ENVIRONMENT "${_openai_env}")
endforeach()
add_test(NAME openai_docs_curl COMMAND ${_with_service} /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/docs_curl_test.py
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(openai_docs_curl PROPERTIES LABELS "service;openai" TIMEOUT 300 ENVIRONMENT "${_openai_env}")
