// FairQueue<T>: which tenant's waiting request to admit next, by weighted
// fair queuing on per-tenant virtual time (start-time fair queuing).
//
// Every tenant has a FIFO of items and a weight. Serving an item of cost c
// advances its tenant's virtual time by c / weight; Pop serves the waiting
// tenant whose virtual time is smallest (ties: the one that has waited
// longest at that time). A tenant whose queue was empty re-enters at the
// virtual time of the item served last, so being idle earns no credit and a
// long backlog earns no priority: with equal weights, 10 items queued behind
// another tenant's 1000 are all served within the next ~20 pops, and two
// tenants that both keep items waiting are served in the ratio of their
// weights.
//
// Pop and Push are O(log tenants). Not thread-safe: the admission lock of the
// caller guards it. Depends on the standard library only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include <glog/logging.h>

namespace penumbra::tenants {

template <typename T>
class FairQueue {
 public:
  struct Picked {
    std::string tenant;
    T item;
  };

  // The tenant's share; > 0. Applies to items served from now on. A tenant
  // never given one has weight 1.
  void SetWeight(const std::string& tenant, double weight) {
    CHECK(weight > 0) << "fair-share weight of '" << tenant << "' must be > 0, got " << weight;
    lanes_[tenant].weight = weight;
  }

  // Queues `item` behind the tenant's others. `cost` (> 0) is what serving it
  // uses of the tenant's share, e.g. 1 per request or its prompt tokens.
  void Push(const std::string& tenant, T item, double cost = 1.0) {
    CHECK(cost > 0) << "fair-share cost must be > 0, got " << cost;
    Lane& lane = lanes_[tenant];
    if (lane.items.empty()) {
      lane.virtual_time = std::max(lane.virtual_time, virtual_now_);
      lane.order = next_order_++;
      waiting_.emplace(lane.virtual_time, lane.order, tenant);
    }
    lane.items.push_back({std::move(item), cost});
    ++size_;
  }

  // The next item to admit and its tenant, or nullopt when nothing waits.
  std::optional<Picked> Pop() {
    if (waiting_.empty()) return std::nullopt;
    auto first = waiting_.begin();
    const auto [start, order, tenant] = *first;
    waiting_.erase(first);
    Lane& lane = lanes_.at(tenant);
    Item item = std::move(lane.items.front());
    lane.items.pop_front();
    --size_;
    virtual_now_ = start;
    lane.virtual_time = start + item.cost / lane.weight;
    if (!lane.items.empty()) {
      lane.order = next_order_++;
      waiting_.emplace(lane.virtual_time, lane.order, tenant);
    }
    return Picked{tenant, std::move(item.value)};
  }

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  size_t size(const std::string& tenant) const {
    auto it = lanes_.find(tenant);
    return it == lanes_.end() ? 0 : it->second.items.size();
  }

 private:
  struct Item {
    T value;
    double cost;
  };
  struct Lane {
    std::deque<Item> items;
    double weight = 1.0;
    double virtual_time = 0;  // when its next item may start, in virtual time
    uint64_t order = 0;       // tie-break: when it last joined `waiting_`
  };

  std::map<std::string, Lane> lanes_;  // every tenant seen (a few: from the config)
  // The tenants with items, by (virtual_time, order).
  std::set<std::tuple<double, uint64_t, std::string>> waiting_;
  double virtual_now_ = 0;  // the start time of the item served last
  uint64_t next_order_ = 0;
  size_t size_ = 0;
};

}  // namespace penumbra::tenants
