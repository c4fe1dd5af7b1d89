// What the fuzzers that make their own text seeds share: run with
// PENUMBRA_FUZZ_SEEDS=DIR (.ci/fuzz.sh does, before fuzzing), each seed is
// written to DIR/seed0, DIR/seed1, ...
#pragma once

#include <cstddef>
#include <cstdlib>
#include <fstream>
#include <string>

namespace penumbra::testing {

template <size_t N>
void WriteFuzzSeeds(const char* const (&seeds)[N]) {
  const char* dir = std::getenv("PENUMBRA_FUZZ_SEEDS");
  if (dir == nullptr) return;
  for (size_t i = 0; i < N; ++i) std::ofstream(std::string(dir) + "/seed" + std::to_string(i)) << seeds[i];
}

}  // namespace penumbra::testing
