#include "worker/engine/value_tiers.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace penumbra {

Status TierOptions::Validate() const {
  if (!(gpu_low_watermark > 0 && gpu_low_watermark <= gpu_high_watermark && gpu_high_watermark <= 1)) {
    return Status::InvalidArgument("gpu.low_watermark and gpu.high_watermark: need 0 < low <= high <= 1, got " +
                                   std::to_string(gpu_low_watermark) + " and " + std::to_string(gpu_high_watermark));
  }
  if (!(heat_half_life_steps > 0)) {
    return Status::InvalidArgument("gpu.heat_half_life_steps: must be > 0, got " +
                                   std::to_string(heat_half_life_steps));
  }
  if (!(replace_ratio >= 1)) {
    return Status::InvalidArgument("gpu.replace_ratio: must be >= 1, got " + std::to_string(replace_ratio));
  }
  if (promote_min_reads < 0) {
    return Status::InvalidArgument("gpu.promote_min_reads: must be >= 0, got " + std::to_string(promote_min_reads));
  }
  return Status::OK();
}

ValueTiers::~ValueTiers() = default;  // copies are freed with their documents

bool ValueTiers::enabled() const { return o_.gpu_capacity_bytes > 0 && (!device_is_host_ || o_.on_host_backend); }

size_t ValueTiers::Held() const {
  size_t n = 0;
  for (const auto& [w, d] : docs_) {
    if (auto p = d.prefix.lock()) n += p->promoted_bytes();
  }
  return n;
}

double ValueTiers::Density(const Doc& d, const KvPrefix& p) {
  return d.heat / static_cast<double>(std::max<size_t>(1, p.promotable_bytes()));
}

double ValueTiers::heat(const KvPrefix* p) const {
  for (const auto& [w, d] : docs_) {
    auto q = d.prefix.lock();
    if (q.get() == p) return d.heat;
  }
  return 0;
}

std::pair<std::shared_ptr<const KvPrefix>, double> ValueTiers::Coldest(const KvPrefix* except) const {
  std::shared_ptr<const KvPrefix> best;
  double best_density = 0;
  for (const auto& [w, d] : docs_) {
    auto p = d.prefix.lock();
    if (!p || p.get() == except || p->promoted_bytes() == 0) continue;
    const double density = Density(d, *p);
    if (!best || density < best_density) {
      best = p;
      best_density = density;
    }
  }
  return {best, best_density};
}

bool ValueTiers::AnyCandidate() const {
  for (const auto& [w, d] : docs_) {
    auto p = d.prefix.lock();
    if (p && p->promotable_bytes() > 0 && d.heat >= static_cast<double>(o_.promote_min_reads)) return true;
  }
  return false;
}

void ValueTiers::Demote(const KvPrefix& p, bool released) {
  if (p.promoted_bytes() == 0) return;
  p.Demote();
  ++stats_.demotions;
  if (released) ++stats_.released;
  if (auto q = promoting_.lock(); q.get() == &p) promoting_.reset();
}

void ValueTiers::Step(const std::vector<std::shared_ptr<const KvPrefix>>& cached) {
  if (!enabled()) return;
  ++step_;
  // Heat: this step's reads over the decayed past.
  const double decay = std::exp2(-1.0 / o_.heat_half_life_steps);
  for (auto& [w, d] : docs_) d.in_cache = false;
  for (const auto& p : cached) {
    Doc& d = docs_[p];
    d.prefix = p;
    d.in_cache = true;
  }
  for (auto it = docs_.begin(); it != docs_.end();) {
    std::shared_ptr<const KvPrefix> p = it->second.prefix.lock();
    if (p && it->second.in_cache) {
      it->second.heat = it->second.heat * decay + static_cast<double>(p->TakeReads());
      ++it;
      continue;
    }
    // Gone, or out of the cache (a sequence may still hold it): its copy
    // would hold device memory the tier no longer sees.
    if (p) Demote(*p, false);
    it = docs_.erase(it);
  }

  size_t held = Held();
  if (held == 0 && !AnyCandidate()) return;  // nothing to place: no device-memory query on the step's path
  // The tier's size: spare device memory only, re-read every step.
  const size_t free = free_device_bytes_();
  const size_t spare = free > SIZE_MAX - held ? SIZE_MAX : free + held;
  const size_t size = std::min(o_.gpu_capacity_bytes, spare > o_.gpu_reserve_bytes ? spare - o_.gpu_reserve_bytes : 0);
  stats_.size_bytes = size;
  const double high = static_cast<double>(size) * o_.gpu_high_watermark;
  const double low = static_cast<double>(size) * o_.gpu_low_watermark;

  if (static_cast<double>(held) > high) {
    while (static_cast<double>(held) > low) {
      auto [victim, density] = Coldest(nullptr);
      if (!victim) break;
      Demote(*victim, false);
      held = Held();
    }
    return;
  }
  if (step_ < hold_off_until_) return;  // an admission needed the memory lately

  std::shared_ptr<const KvPrefix> next = promoting_.lock();
  if (next && next->promotable_bytes() == 0) {  // nothing (left) to copy
    promoting_.reset();
    next = nullptr;
  }
  if (!next) {
    // The hottest document worth a copy that has none.
    double best_density = 0;
    const Doc* best_doc = nullptr;
    for (const auto& [w, d] : docs_) {
      auto p = d.prefix.lock();
      if (!p || p->promoted_bytes() > 0 || p->promotable_bytes() == 0) continue;
      if (d.heat < static_cast<double>(o_.promote_min_reads)) continue;
      const double density = Density(d, *p);
      if (!next || density > best_density) {
        next = p;
        best_density = density;
        best_doc = &d;
      }
    }
    if (!next) return;
    if (static_cast<double>(held + next->promotable_bytes()) > high) {
      // No room: the coldest complete copy gives way if the candidate is
      // much hotter (its promotion starts at the next step).
      auto [victim, density] = Coldest(next.get());
      if (victim && density * o_.replace_ratio < best_density &&
          static_cast<double>(held - victim->promoted_bytes() + next->promotable_bytes()) <= high) {
        VLOG(1) << "tier 0: a copy (heat " << density << "/B) gives way to a hotter document (" << best_density
                << "/B, heat " << best_doc->heat << ")";
        Demote(*victim, false);
      }
      return;
    }
    promoting_ = next;
  }
  // One layer per step.
  const size_t before = next->promoted_bytes();
  const double room = high - static_cast<double>(held);
  Result<bool> done = next->PromoteStep(room > 0 ? static_cast<size_t>(room) : 0);
  if (!done.ok()) {
    VLOG(1) << "tier 0: promotion stopped: " << done.status();
    Demote(*next, false);
    promoting_.reset();
    return;
  }
  if (next->promoted_bytes() > before) ++stats_.promoted_layers;
  if (*done) {
    ++stats_.promotions;
    promoting_.reset();
  }
}

size_t ValueTiers::Release(size_t need) {
  size_t freed = 0;
  while (freed < need) {
    const std::shared_ptr<const KvPrefix> victim = Coldest(nullptr).first;
    if (!victim) break;
    freed += victim->promoted_bytes();
    Demote(*victim, true);
  }
  if (freed > 0) hold_off_until_ = step_ + static_cast<int64_t>(std::ceil(o_.heat_half_life_steps));
  return freed;
}

TierStats ValueTiers::stats() const {
  TierStats s = stats_;
  s.promoted_bytes = Held();
  s.documents = 0;
  for (const auto& [w, d] : docs_) {
    auto p = d.prefix.lock();
    if (p && p->promoted_bytes() > 0) ++s.documents;
  }
  return s;
}

}  // namespace penumbra
