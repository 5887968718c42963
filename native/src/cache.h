// fluxlike-native: the process-wide cache of oneDNN primitives that every op shares.
//
// Keyed by a vector of integers (the op's kind, dtypes, shapes, strides and parameters);
// guarded by a mutex. A primitive is created outside the lock, on the evaluating thread:
// two threads may both create one for a key, and the first stored wins. When the cache is
// full it is emptied (a training loop uses a handful of shapes; a sweep over many shapes
// should not grow it without bound).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fluxlike_native {

using CacheKey = std::vector<int64_t>;

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    size_t h = 1469598103934665603ull;
    for (auto v : k) {
      h ^= static_cast<size_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};

// Entry: any struct with a `std::string impl` (oneDNN's implementation name).
template <class Entry>
class PrimitiveCache {
 public:
  explicit PrimitiveCache(size_t max_entries) : max_(max_entries) {}

  // The entry for `key`, or nullptr.
  std::shared_ptr<Entry> find(const CacheKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }

  // Stores `entry` under `key` unless another thread stored one first; returns the stored.
  std::shared_ptr<Entry> insert(CacheKey key, std::shared_ptr<Entry> entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (map_.size() >= max_) map_.clear();
    auto [it, inserted] = map_.emplace(std::move(key), std::move(entry));
    return it->second;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return map_.size();
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.clear();
  }

  // (implementation name, count) over the cached entries.
  std::vector<std::pair<std::string, int>> impls() {
    std::map<std::string, int> counts;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [k, e] : map_) counts[e->impl] += 1;
    }
    return {counts.begin(), counts.end()};
  }

 private:
  size_t max_;
  std::mutex mutex_;
  std::unordered_map<CacheKey, std::shared_ptr<Entry>, CacheKeyHash> map_;
};

} // namespace fluxlike_native
