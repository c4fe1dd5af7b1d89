// ValidateJoin (worker/service/group_member.h): what a rank checks of the
// coordinator's JoinGroup before any state changes.
#include <gtest/gtest.h>

#include <string>

#include "worker/service/group_member.h"

namespace penumbra::service {
namespace {

GroupMemberOptions Member(int rank) {
  GroupMemberOptions o;
  o.name = "long";
  o.rank = rank;
  o.world = 2;
  return o;
}

rpc::WorkerJoinGroup Join(int rank) {
  rpc::WorkerJoinGroup j;
  j.name = "long";
  j.epoch = 7;
  j.world = 2;
  j.rank = rank;
  j.rendezvous = rank == 0 ? "" : "10.0.0.5:41000";
  j.secret = "00112233445566778899AABBCCDDEEFF";
  return j;
}

TEST(GroupJoin, AcceptsItsOwnJoinAndAnswersTheSecretsBytes) {
  Result<std::string> s = ValidateJoin(Member(0), Join(0));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->size(), 16u);
  EXPECT_EQ(static_cast<unsigned char>((*s)[15]), 0xFF);
  rpc::WorkerJoinGroup v6 = Join(1);
  v6.rendezvous = "[fd00::5]:41000";
  EXPECT_TRUE(ValidateJoin(Member(1), v6).ok());
}

TEST(GroupJoin, RejectsAJoinThatIsNotThisMembersNamingTheField) {
  const auto rejects = [](GroupMemberOptions o, rpc::WorkerJoinGroup j, const std::string& want) {
    Result<std::string> s = ValidateJoin(o, j);
    ASSERT_FALSE(s.ok()) << want;
    EXPECT_NE(s.status().message().find(want), std::string::npos) << s.status();
  };
  GroupMemberOptions single;
  rejects(single, Join(0), "no group");
  EXPECT_EQ(ValidateJoin(single, Join(0)).status().code(), StatusCode::kFailedPrecondition);
  rpc::WorkerJoinGroup j = Join(1);
  j.name = "other";
  rejects(Member(1), j, "names group \"other\"");
  rejects(Member(0), Join(1), "names rank 1 of 2; this worker is rank 0");
  j = Join(1);
  j.world = 3;
  rejects(Member(1), j, "rank 1 of 3");
  j = Join(1);
  j.epoch = 0;
  rejects(Member(1), j, "epoch must be > 0");
  j = Join(0);
  j.rendezvous = "127.0.0.1:5";
  rejects(Member(0), j, "rank 0 listens");
  j = Join(1);
  j.rendezvous = "";
  rejects(Member(1), j, "needs rank 0's rendezvous");
  for (const char* bad : {"nohost", ":41000", "h:70000", "h:x", "fd00::5:41000", "[fd00::5]41000"}) {
    j.rendezvous = bad;
    rejects(Member(1), j, "rendezvous");
  }
  j.rendezvous = "127.0.0.1:0";
  rejects(Member(1), j, "port 0");
  j = Join(1);
  for (const char* bad : {"", "00112233", "0011223344556677889AABBCCDDEEFF", "zz112233445566778899aabbccddeeff"}) {
    j.secret = bad;
    rejects(Member(1), j, "secret");
  }
}

}  // namespace
}  // namespace penumbra::service
