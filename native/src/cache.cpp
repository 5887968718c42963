// fluxlike-native: the least-recently-used primitive cache (see cache.h).

#include "cache.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>

namespace fluxlike_native {

const char* op_name(Op op) {
  switch (op) {
    case Op::Matmul: return "matmul";
    case Op::Conv: return "conv";
    case Op::Softmax: return "softmax";
    case Op::MaxPool: return "max_pool";
  }
  return "unknown";
}

size_t CacheKeyHash::operator()(const CacheKey& k) const {
  size_t h = 1469598103934665603ull;
  for (auto v : k) {
    h ^= static_cast<size_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  }
  return h;
}

CacheCounts& CacheCounts::operator+=(const CacheCounts& o) {
  size += o.size;
  hits += o.hits;
  misses += o.misses;
  creations += o.creations;
  evictions += o.evictions;
  create_ns += o.create_ns;
  work_bytes += o.work_bytes;
  return *this;
}

namespace {

// False on the creator's thread: its lookups (before each creation) are not the calls'.
thread_local bool g_counted = true;

} // namespace

std::shared_ptr<const Prepared> PrimitiveCache::find(Op op, const CacheKey& key, bool counted) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& counts = counts_[static_cast<int>(op)];
  counted = counted && g_counted;
  auto it = index_.find(key);
  if (it == index_.end()) {
    counts.misses += counted ? 1 : 0;
    return nullptr;
  }
  counts.hits += counted ? 1 : 0;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->value;
}

std::shared_ptr<const Prepared> PrimitiveCache::insert(Op op, CacheKey key,
                                                       std::shared_ptr<const Prepared> made,
                                                       uint64_t ns) {
  std::vector<std::shared_ptr<const Prepared>> dropped;  // released after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  auto& counts = counts_[static_cast<int>(op)];
  counts.creations += 1;
  counts.create_ns += ns;
  auto it = index_.find(key);
  if (it != index_.end()) {  // another thread stored one first
    lru_.splice(lru_.begin(), lru_, it->second);
    dropped.push_back(std::move(made));
    return it->second->value;
  }
  counts.size += 1;
  counts.work_bytes += made->work_bytes;
  lru_.push_front(Node{op, key, made});
  index_.emplace(std::move(key), lru_.begin());
  evict(dropped);
  return made;
}

void PrimitiveCache::forget(Lru::iterator it) {
  auto& counts = counts_[static_cast<int>(it->op)];
  counts.size -= 1;
  counts.work_bytes -= it->value->work_bytes;
  index_.erase(it->key);
  lru_.erase(it);
}

void PrimitiveCache::evict(std::vector<std::shared_ptr<const Prepared>>& dropped) {
  while (lru_.size() > capacity_) {
    auto last = std::prev(lru_.end());
    counts_[static_cast<int>(last->op)].evictions += 1;
    dropped.push_back(last->value);
    forget(last);
  }
}

int PrimitiveCache::misses_before(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = missed_.find(key); it != missed_.end()) {
    int before = it->second;
    it->second = std::min(before + 1, 1 << 20);
    return before;
  }
  // Bounded: a sweep over many shapes forgets them all. Four times the capacity, so that a
  // cycle of more shapes than a small cache holds still meets each again.
  if (missed_.size() >= std::max<size_t>(4 * capacity_, 64)) {
    missed_.clear();
  }
  missed_.emplace(key, 1);
  return 0;
}

size_t PrimitiveCache::capacity() {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

size_t PrimitiveCache::set_capacity(size_t capacity) {
  std::vector<std::shared_ptr<const Prepared>> dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  size_t old = capacity_;
  capacity_ = capacity;
  evict(dropped);
  return old;
}

void PrimitiveCache::clear() {
  creator().clear();  // (first: a pending creation would store its entry after the clear)
  Lru dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  index_.clear();
  missed_.clear();
  dropped.swap(lru_);
  counts_ = {};
}

CacheInfo PrimitiveCache::info() {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheInfo info;
  info.capacity = capacity_;
  info.ops = counts_;
  for (const auto& c : counts_) {
    info.total += c;
  }
  return info;
}

std::vector<std::pair<std::string, int>> PrimitiveCache::impls(Op op) {
  std::map<std::string, int> counts;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& node : lru_) {
      if (node.op == op) {
        counts[node.value->impl] += 1;
      }
    }
  }
  return {counts.begin(), counts.end()};
}

PrimitiveCache& primitive_cache() {
  static PrimitiveCache cache(4096);
  return cache;
}

Creator::Creator() = default;

Creator::~Creator() {
  stop();
}

void Creator::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) {
    thread_.join();  // (after the job it runs; the queued ones are dropped)
  }
}

void Creator::submit(const CacheKey& key, std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_ || !pending_.insert(key).second) {
    return;
  }
  queue_.emplace_back(key, [threads = omp_max_threads(), job = std::move(job)] {
    OmpThreads same(threads);
    job();
  });
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { work(); });
  }
  wake_.notify_one();
}

void Creator::work() {
  // Scheduled only where a core is idle (Linux's SCHED_IDLE; where refused, as any thread): a
  // creation never takes a core from the kernels the evaluating thread runs meanwhile.
  sched_param none{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
  for (;;) {
    std::pair<CacheKey, std::function<void()>> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) {
        queue_.clear();
        pending_.clear();
        idle_.notify_all();
        return;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    run(job.first, job.second);
  }
}

void Creator::run(const CacheKey& key, const std::function<void()>& job) {
  bool counted = g_counted;
  g_counted = false;  // (its lookup is not a call's)
  bool ok = true;
  try {
    job();
  } catch (...) {  // (raised again where the evaluating thread creates it)
    ok = false;
  }
  g_counted = counted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.erase(key);
    if (!ok) {
      failed_.insert(key);
    }
  }
  idle_.notify_all();
}

bool Creator::failed(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return failed_.count(key) != 0;
}

void Creator::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return stop_ || pending_.empty(); });
}

void Creator::finish(const CacheKey& key) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = std::find_if(queue_.begin(), queue_.end(),
                         [&](const auto& job) { return job.first == key; });
  if (it == queue_.end()) {
    return;  // (running on the worker, or none: the caller creates it, the first stored wins;
             // waiting for the idle-priority worker on a busy machine took up to 50 ms)
  }
  auto job = std::move(it->second);
  queue_.erase(it);
  lock.unlock();
  run(key, job);
}

size_t Creator::pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.size();
}

void Creator::clear() {
  wait();
  std::lock_guard<std::mutex> lock(mutex_);
  failed_.clear();
}

namespace {

std::atomic<bool> g_background{true};
std::atomic<int> g_uses_without{3};
std::atomic<Creator*> g_creator{nullptr};

} // namespace

Creator& creator() {
  static std::once_flag once;
  std::call_once(once, [] {
    engine();  // (made first, so that it outlives the worker at exit)
    g_creator = new Creator();
    // At exit the worker finishes its job and stops (stop_creator, which Python's atexit
    // calls first; this handler where the process exits without Python's). Not made for
    // fork(): MLX itself does not evaluate in a child forked after it ran.
    std::atexit(stop_creator);
  });
  return *g_creator;
}

void stop_creator() {
  if (Creator* c = g_creator.load()) {
    c->stop();
  }
}

bool background_creation() {
  return g_background.load(std::memory_order_relaxed);
}

bool set_background_creation(bool on) {
  return g_background.exchange(on);
}

int uses_without_primitive() {
  return g_uses_without.load(std::memory_order_relaxed);
}

int set_uses_without_primitive(int uses) {
  return g_uses_without.exchange(uses);
}

} // namespace fluxlike_native
