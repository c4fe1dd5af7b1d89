// penumbra-coordinator's options: one declaration each
// (coordinator/server/coordinator_options.h), the structs' defaults, the
// ranges they always had, and docs/operations.md's table generated from them.
#include "coordinator/server/coordinator_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/docs_util.h"

namespace penumbra::coordinator {
namespace {

Status Parse(std::vector<std::string> flags, CoordinatorProcessOptions* o) {
  Args a;
  CoordinatorOptionTable().AddFlags(a);
  flags.insert(flags.begin(), "penumbra-coordinator");
  std::vector<char*> p;
  for (std::string& s : flags) p.push_back(s.data());
  PENUMBRA_RETURN_IF_ERROR(a.Parse(static_cast<int>(p.size()), p.data(), 1));
  return CoordinatorOptionTable().ApplyFlags(a, o);
}

TEST(CoordinatorOptions, DefaultsAreTheStructsAndFlagsFillThem) {
  CoordinatorProcessOptions o;
  ASSERT_TRUE(Parse({}, &o).ok());
  EXPECT_EQ(o.coordinator.limits.max_deadline_ms, RequestLimits{}.max_deadline_ms);
  EXPECT_EQ(o.limits.max_frame_bytes, 64 << 20);
  EXPECT_EQ(o.pool.health_interval.count(), 1000);
  Status s = Parse(
      {"--model", "m", "--workers", "a:1", "--max-deadline-s", "5", "--abandon-timeout-s", "9", "--min-free-memory-mb",
       "3", "--max-frame-mb", "2", "--job-concurrency", "4", "--max-connections-per-peer", "7", "--max-stop-ids", "0"},
      &o);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(o.model, "m");
  EXPECT_EQ(o.workers, "a:1");
  EXPECT_EQ(o.coordinator.limits.max_deadline_ms, 5000);
  EXPECT_EQ(o.coordinator.abandon_timeout.count(), 9000);
  EXPECT_EQ(o.coordinator.min_free_memory_bytes, int64_t{3} << 20);
  EXPECT_EQ(o.limits.max_frame_bytes, 2 << 20);
  EXPECT_EQ(o.jobs.max_running_items, 4);
  EXPECT_EQ(o.limits.max_connections_per_peer, 7);
  EXPECT_EQ(o.coordinator.limits.max_stop_ids, 0);
  EXPECT_TRUE(o.coordinator.Validate().ok());
}

TEST(CoordinatorOptions, TheSameRangesAsBefore) {
  for (const auto& [flags, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--abandon-timeout-s", "601"}, "--abandon-timeout-s must be in [1, 600], got 601"},
           {{"--max-stop-ids", "1001"}, "--max-stop-ids must be in [0, 1000]"},
           {{"--health-interval-ms", "9"}, "--health-interval-ms must be in [10, 600000]"},
           {{"--max-frame-mb", "1025"}, "--max-frame-mb must be in [1, 1024]"},
           {{"--max-deadline-s", "0"}, "--max-deadline-s must be in [1, 31536000]"},
           {{"--max-documents", "0"}, "--max-documents must be in [1, 4294967296]"}}) {
    CoordinatorProcessOptions o;
    Status s = Parse(flags, &o);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << flags[0];
    EXPECT_NE(s.message().find(want), std::string::npos) << s;
  }
}

TEST(CoordinatorOptions, DocsComeFromTheTable) {
  EXPECT_TRUE(
      testing::GeneratedDocSectionIs("docs/operations.md", "coordinator options", CoordinatorOptionTable().Markdown()));
}

}  // namespace
}  // namespace penumbra::coordinator
