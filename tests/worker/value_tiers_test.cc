// ValueTiers (tier 0 of the document cache): which documents' values are
// copied to spare device memory. Scenario tests, then a model-based test:
// random reads, cache changes, device-memory pressure and releases against a
// plain model of the heat and the rules, checked after every step.
#include "worker/engine/value_tiers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

namespace penumbra {
namespace {

// A "device" whose free memory the test controls: copies take from it.
struct FakeDevice {
  size_t total = 0, other = 0, used = 0;
  size_t free() const { return total - other - used; }
};

// A document of `layers` layers of `layer_bytes` values each, promotable
// once complete; its copy's bytes are taken from the fake device.
class FakeDoc final : public KvPrefix {
 public:
  FakeDoc(FakeDevice* dev, int layers, size_t layer_bytes) : dev_(dev), layers_(layers), layer_bytes_(layer_bytes) {}
  ~FakeDoc() override { dev_->used -= promoted_bytes(); }
  std::string policy() const override { return "fake"; }
  int64_t tokens() const override { return 1; }
  size_t device_bytes() const override { return 0; }
  Result<std::map<std::string, std::string>> Export() const override { return std::map<std::string, std::string>{}; }
  size_t promotable_bytes() const override { return complete ? layer_bytes_ * layers_ : 0; }
  size_t promoted_bytes() const override { return layer_bytes_ * on_device_; }
  Result<bool> PromoteStep(size_t max_bytes) const override {
    if (!complete) return false;
    if (on_device_ == layers_) return true;
    if (layer_bytes_ > max_bytes || layer_bytes_ > dev_->free()) {
      return Status::ResourceExhausted("no room");
    }
    dev_->used += layer_bytes_;
    ++on_device_;
    return on_device_ == layers_;
  }
  void Demote() const override {
    dev_->used -= promoted_bytes();
    on_device_ = 0;
  }
  int64_t TakeReads() const override { return std::exchange(reads, 0); }

  bool complete = true;
  mutable int64_t reads = 0;
  int layers() const { return layers_; }

 private:
  FakeDevice* dev_;
  int layers_;
  size_t layer_bytes_;
  mutable int on_device_ = 0;
};

constexpr size_t kMiB = size_t{1} << 20;

TierOptions Options() {
  TierOptions o;
  o.gpu_capacity_bytes = 100 * kMiB;
  o.gpu_reserve_bytes = 0;
  o.gpu_high_watermark = 0.9;
  o.gpu_low_watermark = 0.6;
  o.promote_min_reads = 100;
  o.heat_half_life_steps = 4;
  o.replace_ratio = 2;
  return o;
}

struct Fixture {
  explicit Fixture(const TierOptions& o = Options(), size_t total = 1000 * kMiB)
      : tiers(o, false, [this] { return dev.free(); }) {
    dev.total = total;
  }
  std::shared_ptr<FakeDoc> Doc(int layers, size_t layer_mib) {
    return std::make_shared<FakeDoc>(&dev, layers, layer_mib * kMiB);
  }
  FakeDevice dev;
  ValueTiers tiers;
};

using Cache = std::vector<std::shared_ptr<const KvPrefix>>;

TEST(ValueTiersTest, AHotDocumentIsCopiedLayerByLayerAndAColdOneIsNot) {
  Fixture f;
  auto hot = f.Doc(4, 10), cold = f.Doc(4, 10);
  const Cache cache{hot, cold};
  hot->reads = 1000;
  cold->reads = 10;  // under promote_min_reads
  f.tiers.Step(cache);
  EXPECT_EQ(hot->promoted_bytes(), 10 * kMiB);  // one layer per step
  for (int i = 0; i < 3; ++i) f.tiers.Step(cache);
  EXPECT_EQ(hot->promoted_bytes(), 40 * kMiB);
  EXPECT_EQ(cold->promoted_bytes(), 0u);
  const TierStats s = f.tiers.stats();
  EXPECT_EQ(s.promotions, 1);
  EXPECT_EQ(s.promoted_layers, 4);
  EXPECT_EQ(s.promoted_bytes, 40 * kMiB);
  EXPECT_EQ(s.documents, 1);
  // Heat halves every heat_half_life_steps steps.
  EXPECT_NEAR(f.tiers.heat(hot.get()), 1000 * std::exp2(-3.0 / 4), 1e-6);
  // Not complete on the host yet (read lazily): nothing to copy.
  auto lazy = f.Doc(2, 1);
  lazy->complete = false;
  lazy->reads = 100000;
  f.tiers.Step({hot, cold, lazy});
  EXPECT_EQ(lazy->promoted_bytes(), 0u);
}

TEST(ValueTiersTest, OffOrOnAHostBackendNothingMoves) {
  TierOptions o = Options();
  o.gpu_capacity_bytes = 0;
  Fixture off(o);
  auto d = off.Doc(1, 1);
  d->reads = 1 << 20;
  off.tiers.Step({d});
  EXPECT_EQ(d->promoted_bytes(), 0u);
  FakeDevice dev{1000 * kMiB};
  ValueTiers host(Options(), /*device_is_host=*/true, [&] { return dev.free(); });
  EXPECT_FALSE(host.enabled());
  TierOptions on = Options();
  on.on_host_backend = true;
  EXPECT_TRUE(ValueTiers(on, true, [&] { return dev.free(); }).enabled());
}

TEST(ValueTiersTest, TheColdestCopyGivesWayOnlyToAMuchHotterDocument) {
  Fixture f;  // tier: 100 MiB, high 90
  auto a = f.Doc(1, 60), b = f.Doc(1, 60);
  const Cache cache{a, b};
  a->reads = 1000;
  f.tiers.Step(cache);
  ASSERT_EQ(a->promoted_bytes(), 60 * kMiB);
  // b as hot as a: no room, and not hot enough to replace it.
  for (int i = 0; i < 10; ++i) {
    a->reads = 500;
    b->reads = 500;
    f.tiers.Step(cache);
    EXPECT_EQ(a->promoted_bytes(), 60 * kMiB);
    EXPECT_EQ(b->promoted_bytes(), 0u);
  }
  EXPECT_EQ(f.tiers.stats().demotions, 0);
  // a goes cold, b stays hot: a gives way, b is copied at the next step.
  for (int i = 0; i < 20 && b->promoted_bytes() == 0; ++i) {
    b->reads = 5000;
    f.tiers.Step(cache);
  }
  EXPECT_EQ(a->promoted_bytes(), 0u);
  EXPECT_EQ(b->promoted_bytes(), 60 * kMiB);
  EXPECT_EQ(f.tiers.stats().demotions, 1);
}

TEST(ValueTiersTest, WhenTheDeviceFillsCopiesAreFreedDownToTheLowWatermark) {
  Fixture f;
  std::vector<std::shared_ptr<FakeDoc>> docs;
  Cache cache;
  for (int i = 0; i < 4; ++i) {
    docs.push_back(f.Doc(1, 20));
    cache.push_back(docs.back());
  }
  for (int step = 0; step < 8; ++step) {
    for (size_t i = 0; i < docs.size(); ++i) docs[i]->reads = 1000 * static_cast<int64_t>(i + 1);
    f.tiers.Step(cache);
  }
  EXPECT_EQ(f.tiers.stats().promoted_bytes, 80 * kMiB);  // four under the high watermark (90)
  // Sequences take device memory: 10 MiB left free, so the tier's size is
  // 80 + 10 = 90 MiB (high 81, low 54): nothing to free yet.
  f.dev.other = f.dev.total - f.dev.used - 10 * kMiB;
  f.tiers.Step(cache);
  EXPECT_EQ(f.tiers.stats().size_bytes, 90 * kMiB);
  EXPECT_EQ(f.tiers.stats().promoted_bytes, 80 * kMiB);
  f.dev.other += 10 * kMiB;  // none free: size 80, high 72, low 48
  f.tiers.Step(cache);
  EXPECT_LE(f.tiers.stats().promoted_bytes, 48 * kMiB);
  // The coldest (doc 0, then doc 1) went first.
  EXPECT_EQ(docs[0]->promoted_bytes(), 0u);
  EXPECT_EQ(docs[1]->promoted_bytes(), 0u);
  EXPECT_EQ(docs[3]->promoted_bytes(), 20 * kMiB);
}

TEST(ValueTiersTest, ReleaseFreesCopiesForAnAdmissionAndHoldsPromotionsOff) {
  Fixture f;
  auto a = f.Doc(1, 30), b = f.Doc(1, 30);
  const Cache cache{a, b};
  a->reads = 2000;
  b->reads = 1000;
  f.tiers.Step(cache);
  f.tiers.Step(cache);
  ASSERT_EQ(f.tiers.stats().promoted_bytes, 60 * kMiB);
  EXPECT_EQ(f.tiers.Release(10 * kMiB), 30 * kMiB);  // the colder one is enough
  EXPECT_EQ(b->promoted_bytes(), 0u);
  EXPECT_EQ(a->promoted_bytes(), 30 * kMiB);
  EXPECT_EQ(f.tiers.Release(SIZE_MAX), 30 * kMiB);
  EXPECT_EQ(f.tiers.stats().released, 2);
  // No promotion for heat_half_life_steps (4) steps, then again.
  for (int i = 0; i < 3; ++i) {
    a->reads = 2000;
    f.tiers.Step(cache);
    EXPECT_EQ(f.tiers.stats().promoted_bytes, 0u) << i;
  }
  for (int i = 0; i < 3; ++i) {
    a->reads = 2000;
    f.tiers.Step(cache);
  }
  EXPECT_GT(a->promoted_bytes(), 0u);
}

TEST(ValueTiersTest, ADocumentLeavingTheCacheLeavesTheTier) {
  Fixture f;
  auto a = f.Doc(2, 10);
  a->reads = 1000;
  f.tiers.Step({a});
  f.tiers.Step({a});
  ASSERT_EQ(a->promoted_bytes(), 20 * kMiB);
  f.tiers.Step({});  // evicted from the cache (a sequence may still hold it)
  EXPECT_EQ(a->promoted_bytes(), 0u);
  EXPECT_EQ(f.dev.used, 0u);
  auto b = f.Doc(2, 10);
  b->reads = 1000;
  f.tiers.Step({b});
  b.reset();  // gone while being promoted: its copy went with it
  f.tiers.Step({});
  EXPECT_EQ(f.dev.used, 0u);
  EXPECT_EQ(f.tiers.stats().documents, 0);
}

// Model-based: random steps against the rules, checked after every step.
TEST(ValueTiersTest, RandomWorkloadsKeepTheRules) {
  TierStats total;  // the workloads do exercise the rules
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    std::mt19937 rng(seed);
    TierOptions o = Options();
    o.gpu_capacity_bytes = (50 + rng() % 150) * kMiB;
    o.gpu_reserve_bytes = (rng() % 3) * 10 * kMiB;
    Fixture f(o, 400 * kMiB);
    std::vector<std::shared_ptr<FakeDoc>> docs;
    std::map<const KvPrefix*, double> heat;  // the model's
    const double decay = std::exp2(-1.0 / o.heat_half_life_steps);
    int64_t step = 0;
    for (int it = 0; it < 300; ++it) {
      const int op = static_cast<int>(rng() % 20);
      if (op == 0 && docs.size() < 8) {  // a document enters the cache
        docs.push_back(f.Doc(1 + static_cast<int>(rng() % 4), 1 + rng() % 20));
        docs.back()->complete = rng() % 4 != 0;
      } else if (op == 1 && !docs.empty()) {  // one leaves it
        const size_t i = rng() % docs.size();
        heat.erase(docs[i].get());
        docs.erase(docs.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (op == 2) {  // sequences take or give back device memory
        const size_t room = f.dev.total - f.dev.used;
        f.dev.other = std::min<size_t>(room, (rng() % 400) * kMiB);
      } else if (op == 3) {
        f.tiers.Release((rng() % 50) * kMiB);
        if (f.tiers.stats().promoted_bytes == 0) {
          EXPECT_EQ(f.dev.used, 0u);
        }
      } else if (op == 4 && !docs.empty()) {
        docs[rng() % docs.size()]->complete = true;  // a lazy read finished
      }
      for (auto& d : docs) d->reads = rng() % 3 == 0 ? static_cast<int64_t>(rng() % 400) : 0;
      Cache cache(docs.begin(), docs.end());
      std::map<const KvPrefix*, int64_t> reads;
      for (auto& d : docs) reads[d.get()] = d->reads;
      const size_t held_before = f.dev.used;
      std::map<const KvPrefix*, size_t> before;
      for (auto& d : docs) before[d.get()] = d->promoted_bytes();
      f.tiers.Step(cache);
      ++step;
      // Heat: decayed reads.
      for (auto& d : docs) {
        double& h = heat[d.get()];
        h = h * decay + static_cast<double>(reads[d.get()]);
        EXPECT_NEAR(f.tiers.heat(d.get()), h, 1e-6 * (1 + h)) << "seed " << seed << " step " << step;
      }
      // Bytes: the tier's copies are exactly what the device lent.
      const TierStats s = f.tiers.stats();
      size_t sum = 0;
      int partial = 0;
      for (auto& d : docs) {
        sum += d->promoted_bytes();
        if (d->promoted_bytes() > 0 && d->promoted_bytes() < d->promotable_bytes()) ++partial;
        if (d->promoted_bytes() > 0) {
          EXPECT_TRUE(d->complete) << "an incomplete document was copied";
        }
      }
      EXPECT_EQ(sum, f.dev.used);
      EXPECT_EQ(s.promoted_bytes, sum);
      EXPECT_LE(partial, 1) << "one promotion at a time";
      // Never above the high watermark of spare memory after a step.
      const size_t spare = f.dev.free() + sum;
      const size_t size = std::min(o.gpu_capacity_bytes, spare > o.gpu_reserve_bytes ? spare - o.gpu_reserve_bytes : 0);
      EXPECT_LE(static_cast<double>(sum), static_cast<double>(size) * o.gpu_high_watermark + 1)
          << "seed " << seed << " step " << step << " held before " << held_before;
      // A copy starts only for a document at least promote_min_reads hot.
      for (auto& d : docs) {
        if (before[d.get()] == 0 && d->promoted_bytes() > 0) {
          EXPECT_GE(heat[d.get()], static_cast<double>(o.promote_min_reads)) << "seed " << seed;
        }
      }
    }
    const TierStats s = f.tiers.stats();
    total.promotions += s.promotions;
    total.demotions += s.demotions;
    total.released += s.released;
    docs.clear();
    EXPECT_EQ(f.dev.used, 0u);
  }
  EXPECT_GT(total.promotions, 100);
  EXPECT_GT(total.demotions, 50);
  EXPECT_GT(total.released, 10);
  std::printf("promotions %lld, demotions %lld (released %lld)\n", static_cast<long long>(total.promotions),
              static_cast<long long>(total.demotions), static_cast<long long>(total.released));
}

}  // namespace
}  // namespace penumbra
