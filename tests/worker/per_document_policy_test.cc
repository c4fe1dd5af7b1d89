// The per-document KV policy's cases (per_document_policy_cases.h) on the
// CPU backend (f32), and its pinned forms, spindlekv and specontext.
#include "tests/worker/per_document_policy_cases.h"

namespace penumbra {
namespace {

void PerDocumentPolicyTest::SkipWithoutGpu() {}

// On the CPU, auto holds spindlekv too, by pin only: a put pinned to it is
// held so and its unpinned questions attach it and answer as a spindlekv
// engine does; a decode batch mixing the three forms gives each row what it
// gets alone.
TEST_P(PerDocumentPolicyTest, OnTheCpuSpindleKvIsAThirdFormHeldByItsPin) {
  // Else the checks below could not tell which form answered.
  ASSERT_GT(MaxDiff(ColdLogits(Ask(kDocA, kQ1), "spindlekv"), ColdLogits(Ask(kDocA, kQ1), "full")), Close());
  auto e = Open("auto");
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  EXPECT_EQ(rt.policy().Forms(), (std::vector<std::string>{"full", "shadowkv", "spindlekv", "specontext"}));
  GenerationRequest put = Ask(kDocA, {}, "spindlekv");
  put.max_new_tokens = 0;
  auto p = rt.Generate({put});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Documents(rt), (std::map<std::string, int64_t>{{"spindlekv", 1}}));
  auto q = rt.Generate({Ask(kDocA, kQ1)});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)[0].cached_prompt_tokens, 151);
  EXPECT_EQ((*q)[0].ids, Cold(Ask(kDocA, kQ1), "spindlekv"));
  EXPECT_LE(MaxDiff(Logits(rt, Ask(kDocA, kQ1)), ColdLogits(Ask(kDocA, kQ1), "spindlekv")), Same());
  // Held as spindlekv: a question pinned to another form prefills its own.
  auto f = rt.Generate({Ask(kDocA, kQ2, "full")});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)[0].cached_prompt_tokens, 0);
  EXPECT_EQ((*f)[0].ids, Cold(Ask(kDocA, kQ2), "full"));
  // One decode step of the three forms together, then each alone (the
  // linear layers' batch of 4 against 1: Close, as the two-form case).
  ExpectEachRowAsAlone(rt,
                       {Ask(kDocB, kQ1, "spindlekv"), Ask(kDocB, kQ2, "full"), Ask(kDocA, kQ2, "shadowkv"),
                        Ask(kDocA, kQ2, "spindlekv")},
                       {5, 6, 7, 8});
}

// With a retrieval head, specontext is a fourth form, by pin only: a put
// pinned to it is held so (its layers' keys and values, the head's keys), its
// unpinned questions attach it and answer as a specontext engine does, and a
// decode batch whose specontext rows are not one run of the batch (their
// tokens gathered for the head) gives each row what it gets alone.
TEST_P(PerDocumentPolicyTest, WithAHeadSpeContextIsAFourthFormHeldByItsPin) {
  // Its prefill is exact (full attention's logits): its decode steps tell it
  // apart.
  ASSERT_NE(Cold(Ask(kDocA, kQ1), "specontext"), Cold(Ask(kDocA, kQ1), "full"));
  auto e = Open("auto");
  ASSERT_NE(e, nullptr);
  Runtime& rt = e->runtime();
  GenerationRequest put = Ask(kDocA, {}, "specontext");
  put.max_new_tokens = 0;
  auto p = rt.Generate({put});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Documents(rt), (std::map<std::string, int64_t>{{"specontext", 1}}));
  auto q = rt.Generate({Ask(kDocA, kQ1)});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ((*q)[0].cached_prompt_tokens, 151);
  EXPECT_EQ((*q)[0].ids, Cold(Ask(kDocA, kQ1), "specontext"));
  ExpectEachRowAsAlone(rt,
                       {Ask(kDocA, kQ2, "specontext"), Ask(kDocB, kQ2, "full"), Ask(kDocB, kQ1, "specontext"),
                        Ask(kDocA, kQ2, "shadowkv")},
                       {5, 6, 7, 8});
}

INSTANTIATE_TEST_SUITE_P(Cpu, PerDocumentPolicyTest, ::testing::Values("cpu"));

}  // namespace
}  // namespace penumbra
