// Sections of the docs generated from the code (an option table's Markdown):
// a test checks that the committed text between the markers
//   <!-- NAME: generated -->  ...  <!-- end NAME -->
// is exactly what the code generates, and rewrites it instead when
// PENUMBRA_WRITE_DOCS is set (then the test passes and the file changed).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/test_util.h"

namespace penumbra::testing {

inline ::testing::AssertionResult GeneratedDocSectionIs(const std::string& doc_relative, const std::string& name,
                                                        const std::string& want) {
  const std::string path = SourceDir() + "/" + doc_relative;
  std::ifstream in(path);
  if (!in) return ::testing::AssertionFailure() << "cannot read " << path;
  std::stringstream buf;
  buf << in.rdbuf();
  std::string doc = buf.str();
  const std::string begin = "<!-- " + name + ": generated -->\n", end = "<!-- end " + name + " -->";
  const size_t b = doc.find(begin), e = doc.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) {
    return ::testing::AssertionFailure() << path << " lacks the markers '" << begin << "' and '" << end << "'";
  }
  const std::string have = doc.substr(b + begin.size(), e - b - begin.size());
  if (have == want) return ::testing::AssertionSuccess();
  if (std::getenv("PENUMBRA_WRITE_DOCS") != nullptr) {
    doc.replace(b + begin.size(), e - b - begin.size(), want);
    std::ofstream(path) << doc;
    return ::testing::AssertionSuccess() << "rewrote " << path;
  }
  return ::testing::AssertionFailure() << path << ", section " << name
                                       << ", differs from what the code generates (rerun the test with "
                                          "PENUMBRA_WRITE_DOCS=1 to rewrite it):\n"
                                       << want;
}

}  // namespace penumbra::testing
