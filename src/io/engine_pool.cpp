// EnginePool: idle engines kept for reuse (see engine.hpp).
#include <pthread.h>

#include <mutex>
#include <utility>

#include "hbmio/config.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/threads.hpp"

#include "core/executor.hpp"

namespace hbmio {

EnginePool::~EnginePool() = default;

EnginePool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      backend_(std::move(other.backend_)),
      workers_(other.workers_),
      engine_(std::move(other.engine_)) {}

EnginePool::Lease& EnginePool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    give_back();
    pool_ = std::exchange(other.pool_, nullptr);
    backend_ = std::move(other.backend_);
    workers_ = other.workers_;
    engine_ = std::move(other.engine_);
  }
  return *this;
}

EnginePool::Lease::~Lease() { give_back(); }

void EnginePool::Lease::give_back() noexcept {
  if (pool_ != nullptr && engine_) pool_->give_back(backend_, workers_, std::move(engine_));
  pool_ = nullptr;
  engine_.reset();
}

EnginePool::Lease EnginePool::acquire(std::string_view requested, unsigned workers) {
  // The configured backend, resolved here so that its engines are kept under its own name.
  const std::string backend = requested.empty() ? configured_backend() : std::string(requested);
  {
    std::lock_guard lock(mutex_);
    if (auto it = idle_.find(backend); it != idle_.end()) {
      auto& idle = it->second;
      // The most recently given back of the asked size: its pinned memory is the likeliest warm.
      for (auto e = idle.rbegin(); e != idle.rend(); ++e)
        if (e->workers == workers) {
          auto engine = std::move(e->engine);
          idle.erase(std::next(e).base());
          return Lease(this, backend, workers, std::move(engine));
        }
    }
  }
  Options options = Options::from_env();
  if (workers != 0) options.workers = workers;
  // Outside the lock: making an engine can take a while (cuFile's driver opens on first use).
  return Lease(this, backend, workers, make_engine(backend, options));
}

void EnginePool::give_back(const std::string& backend, unsigned workers, std::unique_ptr<Engine> engine) noexcept {
  std::unique_ptr<Engine> evicted;
  try {
    std::lock_guard lock(mutex_);
    if (max_idle_ > 0) {
      auto& idle = idle_[backend];
      // Full: the oldest idle engine makes room, so that a size in use now is kept rather than
      // one no caller has asked for since.
      if (idle.size() >= max_idle_) {
        evicted = std::move(idle.front().engine);
        idle.erase(idle.begin());
      }
      idle.reserve(idle.size() + 1);  // what may throw, before the engine moves: push_back cannot
      idle.push_back({workers, std::move(engine)});
    }
  } catch (...) {  // no memory for the map entry or the slot: free the engine instead
  }
  // `engine` (unless kept) and `evicted` are freed here, outside the lock: freeing pinned memory
  // and joining threads can take a while.
}

std::size_t EnginePool::release_all() {
  decltype(idle_) doomed;
  {
    std::lock_guard lock(mutex_);
    doomed.swap(idle_);
  }
  std::size_t n = 0;
  for (const auto& [name, engines] : doomed) n += engines.size();
  return n;  // `doomed` frees them here, outside the lock
}

void shutdown() {
  detail::Executor::shared().shutdown();  // first: a background persist may hold an engine
  EnginePool::shared().release_all();
}

std::map<std::string, std::size_t> EnginePool::idle_counts() const {
  std::lock_guard lock(mutex_);
  std::map<std::string, std::size_t> counts;
  for (const auto& [name, engines] : idle_)
    if (!engines.empty()) counts[name] = engines.size();
  return counts;
}

namespace {
EnginePool* shared_pool = nullptr;  // set once; replaced in a child of fork()
}  // namespace

EnginePool& EnginePool::shared() {
  static std::once_flag made;
  std::call_once(made, [] {
    shared_pool = new EnginePool();
    // A child of fork() has none of the idle engines' worker threads: a save or load there that
    // reused one would wait for workers that do not exist, and freeing one would join them. The
    // child starts with an empty pool and leaves the parent's as it is (leaked); the child handler
    // runs with one thread, so the plain store is safe.
    ::pthread_atfork(nullptr, nullptr, [] { shared_pool = new EnginePool(); });
  });
  return *shared_pool;
}

}  // namespace hbmio
