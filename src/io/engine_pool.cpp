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
    : pool_(std::exchange(other.pool_, nullptr)), backend_(std::move(other.backend_)), engine_(std::move(other.engine_)) {}

EnginePool::Lease& EnginePool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    give_back();
    pool_ = std::exchange(other.pool_, nullptr);
    backend_ = std::move(other.backend_);
    engine_ = std::move(other.engine_);
  }
  return *this;
}

EnginePool::Lease::~Lease() { give_back(); }

void EnginePool::Lease::give_back() noexcept {
  if (pool_ != nullptr && engine_) pool_->give_back(backend_, std::move(engine_));
  pool_ = nullptr;
  engine_.reset();
}

EnginePool::Lease EnginePool::acquire(std::string_view requested) {
  // The configured backend, resolved here so that its engines are kept under its own name.
  const std::string backend = requested.empty() ? configured_backend() : std::string(requested);
  {
    std::lock_guard lock(mutex_);
    if (auto it = idle_.find(backend); it != idle_.end() && !it->second.empty()) {
      auto engine = std::move(it->second.back());
      it->second.pop_back();
      return Lease(this, backend, std::move(engine));
    }
  }
  // Outside the lock: making an engine can take a while (cuFile's driver opens on first use).
  return Lease(this, backend, make_engine(backend, Options::from_env()));
}

void EnginePool::give_back(const std::string& backend, std::unique_ptr<Engine> engine) noexcept {
  try {
    std::lock_guard lock(mutex_);
    auto& idle = idle_[backend];
    if (idle.size() < max_idle_) {
      idle.push_back(std::move(engine));
      return;
    }
  } catch (...) {  // no memory for the map entry: free the engine instead
  }
  engine.reset();  // outside the lock: freeing pinned memory can take a while
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
