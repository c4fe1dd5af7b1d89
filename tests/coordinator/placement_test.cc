// The coordinator's placement order (coordinator/server/placement.h):
// document holders first; within a group, workers with room before those
// short of memory, then the least loaded, then the fewest documents, then
// the most free memory, then the index. And the --groups list.
#include "coordinator/server/placement.h"
#include "coordinator/server/worker_pool.h"

#include <gtest/gtest.h>

namespace penumbra::coordinator {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

PlacementCandidate W(int i, bool holds, int64_t routed, int64_t docs, int64_t free) {
  return PlacementCandidate{i, holds, routed, docs, free};
}

TEST(PlacementTest, HoldersFirstThenLoadThenDocumentsThenMemory) {
  EXPECT_EQ(OrderWorkers({W(0, false, 0, 0, 40 * kGiB), W(1, true, 5, 3, 10 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  EXPECT_EQ(OrderWorkers({W(0, false, 3, 0, 40 * kGiB), W(1, false, 1, 9, 10 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  EXPECT_EQ(OrderWorkers({W(0, false, 1, 4, 40 * kGiB), W(1, false, 1, 2, 10 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  EXPECT_EQ(OrderWorkers({W(0, false, 1, 2, 10 * kGiB), W(1, false, 1, 2, 40 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  EXPECT_EQ(OrderWorkers({W(2, false, 1, 2, 10 * kGiB), W(1, false, 1, 2, 10 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 2}));
}

TEST(PlacementTest, AWorkerShortOfMemoryGoesAfterItsGroup) {
  // Idle but nearly full: after a busier worker with room.
  EXPECT_EQ(OrderWorkers({W(0, false, 0, 0, kGiB / 2), W(1, false, 7, 0, 30 * kGiB)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  // A holder short of memory still comes before every non-holder (its
  // document is there already).
  EXPECT_EQ(OrderWorkers({W(0, false, 0, 0, 30 * kGiB), W(1, true, 0, 1, kGiB / 2)}, 2 * kGiB),
            (std::vector<int>{1, 0}));
  // Unknown memory (-1) is not short; the threshold 0 turns the rule off.
  EXPECT_EQ(OrderWorkers({W(0, false, 2, 0, kGiB / 2), W(1, false, 1, 0, -1)}, 2 * kGiB), (std::vector<int>{1, 0}));
  EXPECT_EQ(OrderWorkers({W(0, false, 0, 0, kGiB / 2), W(1, false, 1, 0, 30 * kGiB)}, 0), (std::vector<int>{0, 1}));
}

TEST(PlacementTest, EmptyStaysEmpty) { EXPECT_TRUE(OrderWorkers({}, 0).empty()); }

// --groups: each group's ranks in rank order, named or not.
TEST(PlacementTest, GroupsAreParsedInRankOrder) {
  auto g = ParseGroups("g0=a=10.0.0.1:7000,10.0.0.2:7000;big=h:1,h:2,h:3");
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->size(), 5u);
  EXPECT_EQ((*g)[0].name, "a");
  EXPECT_EQ((*g)[1].name, "g0.r1");
  EXPECT_EQ((*g)[1].host, "10.0.0.2");
  EXPECT_EQ((*g)[1].group, "g0");
  EXPECT_EQ((*g)[1].rank, 1);
  EXPECT_EQ((*g)[1].world, 2);
  EXPECT_EQ((*g)[4].group, "big");
  EXPECT_EQ((*g)[4].rank, 2);
  EXPECT_EQ((*g)[4].world, 3);
  ASSERT_TRUE(ParseGroups("").ok());
  EXPECT_TRUE(ParseGroups("")->empty());
  for (const char* bad : {"g0=h:1", "=h:1,h:2", "g0", "g0=h:1,h", "g0=h:1,h:2;g0=h:3,h:4", "g0=h:1,h:99999"}) {
    auto r = ParseGroups(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace penumbra::coordinator
