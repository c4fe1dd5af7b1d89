// penumbra-store's options: one declaration each
// (store_node/store_node_options.h), the structs' defaults, the ranges they
// always had, and docs/operations.md's table generated from them.
#include "store_node/store_node_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/docs_util.h"

namespace penumbra::transport {
namespace {

Status Parse(std::vector<std::string> flags, StoreNodeProcessOptions* o) {
  Args a;
  StoreNodeOptionTable().AddFlags(a);
  flags.insert(flags.begin(), "penumbra-store");
  std::vector<char*> p;
  for (std::string& s : flags) p.push_back(s.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(p.size()), p.data(), 1));
  return StoreNodeOptionTable().ApplyFlags(a, o);
}

TEST(StoreNodeOptions, DefaultsAreTheStructsAndFlagsFillThem) {
  StoreNodeProcessOptions o;
  ASSERT_TRUE(Parse({}, &o).ok());
  EXPECT_EQ(o.node.plane.threads, 8);
  EXPECT_EQ(o.node.service.max_upload_bytes, 0u) << "half the machine's memory";
  Status s = Parse({"--path", "/tmp/x", "--threads", "3", "--reader-idle-seconds", "0.25", "--max-upload-mb", "5",
                    "--handshake-timeout-ms", "40", "--host", "0.0.0.0"},
                   &o);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.path, "/tmp/x");
  EXPECT_EQ(o.node.host, "0.0.0.0");
  EXPECT_EQ(o.node.plane.threads, 3);
  EXPECT_DOUBLE_EQ(o.node.service.reader_idle_seconds, 0.25);
  EXPECT_EQ(o.node.service.max_upload_bytes, uint64_t{5} << 20);
  EXPECT_EQ(o.node.plane.handshake_timeout.count(), 40);
}

TEST(StoreNodeOptions, TheSameRangesAsBefore) {
  for (const auto& [flags, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--reader-idle-seconds", "0"}, "--reader-idle-seconds must be in (0, inf], got 0"},
           {{"--upload-idle-seconds", "-1"}, "--upload-idle-seconds must be in (0, inf]"},
           {{"--max-upload-mb", "0"}, "--max-upload-mb must be in [1, 1073741824], got 0"},
           {{"--threads", "257"}, "--threads must be in [1, 256]"},
           {{"--handshake-timeout-ms", "0"}, "--handshake-timeout-ms must be in [1, 3600000]"}}) {
    StoreNodeProcessOptions o;
    Status s = Parse(flags, &o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << flags[0];
    EXPECT_NE(s.message().find(want), std::string::npos) << s;
  }
}

TEST(StoreNodeOptions, DocsComeFromTheTable) {
  EXPECT_TRUE(
      testing::GeneratedDocSectionIs("docs/operations.md", "store node options", StoreNodeOptionTable().Markdown()));
}

}  // namespace
}  // namespace penumbra::transport
