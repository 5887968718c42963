// fluxlike-native: the process-wide cache of prepared oneDNN primitives that every op shares.
//
// Keyed by the op and a vector of integers (its kind, dtypes, shapes, strides and
// parameters). Least recently used entries are evicted when it is full (a sweep over many
// shapes does not grow it without bound, and a training loop's few shapes stay). Guarded by
// a mutex; a primitive is created outside the lock, on the evaluating thread or (for a shape
// whose call can be computed another way, see cached()) on the creator's thread: two threads
// may both create one for a key, and the first stored wins. An evicted entry lives on while
// an execution still holds it.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cpu.h"
#include "engine.h"

namespace fluxlike_native {

// The ops whose primitives are cached; the cache counts each on its own.
enum class Op { Matmul, Conv, Softmax, MaxPool };
constexpr int OP_COUNT = 4;
const char* op_name(Op op);  // "matmul", "conv", "softmax", "max_pool"

using CacheKey = std::vector<int64_t>;

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const;
};

struct CacheCounts {
  uint64_t size = 0;       // entries held
  uint64_t hits = 0;       // lookups that found their entry
  uint64_t misses = 0;     // lookups that did not (each then creates a primitive, unless
                           // deferred: see cached()); the creator's own are not counted
  uint64_t creations = 0;  // primitives created (a thread that lost a race counts too)
  uint64_t evictions = 0;  // entries dropped to keep within the capacity
  uint64_t create_ns = 0;  // time spent creating primitives
  uint64_t work_bytes = 0; // the entries' work_bytes (see Prepared), summed

  CacheCounts& operator+=(const CacheCounts& o);
};

struct CacheInfo {
  uint64_t capacity = 0;
  CacheCounts total;
  std::array<CacheCounts, OP_COUNT> ops;
};

class PrimitiveCache {
 public:
  explicit PrimitiveCache(size_t capacity) : capacity_(capacity) {}

  // The entry for `key` (whose first element is the op, see cached()), made the most
  // recently used; nullptr (a miss) if there is none. Counted unless `counted` is false.
  std::shared_ptr<const Prepared> find(Op op, const CacheKey& key, bool counted = true);

  // Stores `made` (created in `ns` nanoseconds) unless another thread stored an entry for
  // the key first; returns the stored one. Evicts the least recently used beyond capacity.
  std::shared_ptr<const Prepared> insert(Op op, CacheKey key,
                                         std::shared_ptr<const Prepared> made, uint64_t ns);

  // How many times `key` missed before (since the last clear; at most 2**20);
  // remembers this miss. At most 4 x `capacity` keys (at least 64) are remembered (all
  // forgotten when more come). A miss is not counted.
  int misses_before(const CacheKey& key);
  size_t capacity();

  // Sets the capacity (0: nothing is kept), evicting down to it; returns the old one.
  size_t set_capacity(size_t capacity);
  // Drops every entry and zeroes the counts (as functools.lru_cache's cache_clear).
  void clear();
  CacheInfo info();
  // (implementation name, count) over the op's entries.
  std::vector<std::pair<std::string, int>> impls(Op op);

 private:
  struct Node {
    Op op;
    CacheKey key;
    std::shared_ptr<const Prepared> value;
  };
  using Lru = std::list<Node>;  // most recently used first

  // Drops entries from the back down to the capacity (under the lock); the entries are
  // moved to `dropped`, to be released after it.
  void evict(std::vector<std::shared_ptr<const Prepared>>& dropped);
  void forget(Lru::iterator it);

  size_t capacity_;
  std::mutex mutex_;
  Lru lru_;
  std::unordered_map<CacheKey, Lru::iterator, CacheKeyHash> index_;
  std::unordered_map<CacheKey, int, CacheKeyHash> missed_;
  std::array<CacheCounts, OP_COUNT> counts_{};
};

// The cache every op uses (4096 entries unless set_capacity says otherwise).
PrimitiveCache& primitive_cache();

// Creation off the critical path: one worker thread, started on first use, that runs the jobs
// cached() queues (each creates a primitive and stores it in the cache) one at a time, in
// order, with the OpenMP thread count the evaluating thread had (the thread count a primitive
// is created for decides how it splits, and so its results, see cpu.h). A key is queued once
// while its job is pending; a job that throws marks its key failed (the next miss creates on
// the evaluating thread, which raises the error there). Stopped at exit.
class Creator {
 public:
  Creator();
  ~Creator();
  Creator(const Creator&) = delete;
  Creator& operator=(const Creator&) = delete;

  // Queues `job` for `key` unless a job for it is pending.
  void submit(const CacheKey& key, std::function<void()> job);
  // Whether a job for `key` threw (remembered until clear()).
  bool failed(const CacheKey& key);
  // Blocks until no job is queued or running.
  void wait();
  // The job for `key` run here if it is still queued (at this thread's priority: the worker's
  // is the lowest); nothing else (a job the worker runs is not waited for).
  void finish(const CacheKey& key);
  // Jobs queued or running (here or in finish()).
  size_t pending();
  // Waits, then forgets the failed keys.
  void clear();
  // Ends the worker after the job it runs (the queued ones dropped; later ones refused).
  void stop();

 private:
  void work();
  // Runs `job` (uncounted lookups), then marks `key` done (or failed, if it threw).
  void run(const CacheKey& key, const std::function<void()>& job);

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::pair<CacheKey, std::function<void()>>> queue_;
  std::unordered_set<CacheKey, CacheKeyHash> pending_, failed_;
  bool stop_ = false;
  std::thread thread_;
};

Creator& creator();
// Stops the worker if it was started (see Creator::stop); for exit.
void stop_creator();

// Whether a deferrable key's primitive is created on the creator's thread (the default) or on
// the evaluating thread; set_background_creation returns the old setting.
bool background_creation();
bool set_background_creation(bool on);

// How many uses of a deferrable shape run without its primitive (3 unless set; at least 2):
// its creation is queued at the last of them and the next one uses it. Three, not two: a
// shape seen twice creates nothing. A creation (0.1-0.5 ms of a core) costs more than the
// small calls that defer it, so on 2 cores it slowed whichever calls ran beside it, on the
// worker thread or not: the small CNN's first calls at new image sizes (whose second
// convolution's shape two sizes share) were 1.6-2.4x the kernels-off calls at the 90th
// percentile with creation at the second use, 0.85-1.42 at the third (the machine's own
// noise 1.1-1.45; bench/shapes.py --first-calls, Intel Xeon, 2026-12-05). set_ returns the
// old count.
int uses_without_primitive();
int set_uses_without_primitive(int uses);

// The cached primitive of `op` for `key`, or the one `create()` makes (a shared_ptr to a
// Prepared or a struct derived from it), timed and stored. oneDNN's refusal becomes
// "<fn>: oneDNN has no <what> for these operands (...)".
template <class T, class Create>
std::shared_ptr<const T> cached(Op op, CacheKey key, const char* fn, const char* what,
                                Create&& create);

// The same, for a call that can be computed without the primitive (MLX's kernel, plain
// loops, oneDNN's GEMM): where `defer`, a miss returns nullptr (the caller computes the call
// that other way) instead of waiting for a creation (0.2-0.5 ms on AVX2, more than such a
// call costs). Until `key` has missed uses_without_primitive() - 1 times, nothing more: a
// shape seen that often creates nothing. At the next miss (the third, by default),
// `later()` (a std::function<void()> that makes and stores the primitive, holding copies of
// what it needs) is queued on the creator's thread and the call runs the other way too;
// from the one after, the call uses the primitive: a creation still queued then is made on
// this thread, one the worker is running is made here too (the first stored wins; the same
// primitive: the same thread count), so that a shape's first uses_without_primitive() calls
// run the other way and the later ones its primitive, whatever the worker's timing (seeded
// runs repeat bit for bit), and no call waits on the idle-priority worker. Background
// creation off, or failed for the key: created here at that miss (as without `defer`, which
// raises the error). A cache of capacity 0 keeps nothing: never created then.
template <class T, class Create, class Later>
std::shared_ptr<const T> cached(Op op, CacheKey key, const char* fn, const char* what,
                                Create&& create, bool defer, Later&& later) {
  auto& cache = primitive_cache();
  key.insert(key.begin(), static_cast<int64_t>(op));  // one map for all ops
  if (auto hit = cache.find(op, key)) {
    return std::static_pointer_cast<const T>(hit);
  }
  if (defer) {
    if (cache.capacity() == 0) {
      return nullptr;
    }
    int before = cache.misses_before(key), last = uses_without_primitive() - 1;
    if (before < last) {
      return nullptr;
    }
    if (background_creation() && !creator().failed(key)) {
      if (before == last) {
        creator().submit(key, later());
        return nullptr;
      }
      creator().finish(key);
      if (auto made = cache.find(op, key, /*counted=*/false)) {
        return std::static_pointer_cast<const T>(made);
      }  // (failed, evicted meanwhile, or never queued: made here)
    }
  }
  auto start = std::chrono::steady_clock::now();
  std::shared_ptr<const T> made;
  try {
    made = create();
  } catch (const dnnl::error& err) {
    throw std::runtime_error(std::string(fn) + ": oneDNN has no " + what +
                             " for these operands (" + err.what() + ")");
  }
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - start).count();
  return std::static_pointer_cast<const T>(
      cache.insert(op, std::move(key), std::move(made), static_cast<uint64_t>(ns)));
}

template <class T, class Create>
std::shared_ptr<const T> cached(Op op, CacheKey key, const char* fn, const char* what,
                                Create&& create) {
  return cached<T>(op, std::move(key), fn, what, std::forward<Create>(create), false,
                   [] { return std::function<void()>(); });
}

} // namespace fluxlike_native
