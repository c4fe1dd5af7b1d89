# Helpers shared by every module's CMakeLists.txt.

# Where the build unpacks the test data the repository ships compressed
# (tests/CMakeLists.txt); tests read it through $PENUMBRA_TEST_DATA_DIR.
set(PENUMBRA_TEST_DATA_DIR ${CMAKE_BINARY_DIR}/test_data)

# penumbra_test(NAME LABELS label... SOURCES src... LIBS lib...)
# One GoogleTest binary registered with CTest; tests run from the source root so
# they can find tests/data (and the unpacked data in PENUMBRA_TEST_DATA_DIR).
# Tests' own code compiles at -O0 (with the build's debug info): what a test
# exercises is the libraries' code, built as configured, while its fixtures,
# processes and checks are most of every build's compile time (-O0 compiles
# them 2.5-3x faster than -O2 or ASan's -O1). The folders whose tests compute
# references or models in their own code, and the GPU tests, keep the
# build's optimization.
set(PENUMBRA_TESTS_OPTIMIZED_FOLDERS kernels worker)

# penumbra_test_executable(NAME SOURCES src... LIBS lib...): a GoogleTest
# executable under that rule, not yet registered with CTest (penumbra_test
# registers one; a tests.cmake that registers each case with
# penumbra_gtest_cases makes its executable with this).
function(penumbra_test_executable name)
  cmake_parse_arguments(X "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${X_SOURCES})
  target_link_libraries(${name} PRIVATE ${X_LIBS} GTest::gtest GTest::gtest_main penumbra_warnings)
  list(GET X_SOURCES 0 first)
  get_filename_component(folder ${first} DIRECTORY)
  get_filename_component(folder ${folder} NAME)
  if(NOT name MATCHES "_gpu_test$" AND NOT folder IN_LIST PENUMBRA_TESTS_OPTIMIZED_FOLDERS)
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O0>)
  endif()
endfunction()

function(penumbra_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "LABELS;SOURCES;LIBS" ${ARGN})
  penumbra_test_executable(${name} SOURCES ${T_SOURCES} LIBS ${T_LIBS})
  add_test(NAME ${name} COMMAND ${name} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 900)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "PENUMBRA_SOURCE_DIR=${PROJECT_SOURCE_DIR};PENUMBRA_TEST_DATA_DIR=${PENUMBRA_TEST_DATA_DIR}")
endfunction()

# penumbra_fuzzer(NAME SOURCES src... LIBS lib...)
# A libFuzzer target, built only when PENUMBRA_FUZZ is ON (with clang; every
# target is then compiled with -fsanitize=fuzzer-no-link and the sanitizers
# of PENUMBRA_SANITIZE). `ninja fuzzers` builds them all; .ci/fuzz.sh runs
# each for a bounded time from its seed corpus (tests/fuzz/NAME/ when it
# exists; a fuzzer may also write its own seeds when run with
# PENUMBRA_FUZZ_SEEDS=DIR: see tests/fuzz/README.md).
function(penumbra_fuzzer name)
  if(NOT PENUMBRA_FUZZ)
    return()
  endif()
  cmake_parse_arguments(F "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${F_SOURCES})
  target_link_libraries(${name} PRIVATE ${F_LIBS} penumbra_warnings)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  add_dependencies(fuzzers ${name})
endfunction()
