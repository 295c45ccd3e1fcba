// The execution context (engine-owned worker threads, the caller's CUDA device left alone), the
// one positional-I/O loop, the engine pool, the one place auto decides, the error boundary, and
// fault injection that replays with any number of workers.
#include <gtest/gtest.h>

#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "testing/fault_injection.hpp"
#include "hbmio/checkpoint.hpp"
#include "core/error_boundary.hpp"
#include "hbmio/doctor.hpp"
#include "hbmio/progress.hpp"
#include "io/cufile_verdict.hpp"
#include "io/engine_internal.hpp"
#include "io/page_cache.hpp"
#include "core/positional_io.hpp"
#include "core/worker_threads.hpp"
#include "core/executor.hpp"
#include "memory/cuda_runtime.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {

// Index 0 is the caller's; every other index has a thread of its own, the same one every run
// (an io_uring set up for a single issuer relies on it).
TEST(WorkerThreads, EachIndexRunsOnItsOwnThreadEveryTime) {
  detail::WorkerThreads threads(4, "test worker");
  std::mutex mutex;
  std::vector<std::thread::id> first(4), seen(4);
  threads.run(4, [&](unsigned i) {
    std::lock_guard lock(mutex);
    first[i] = std::this_thread::get_id();
  });
  for (int round = 0; round < 50; ++round) {
    threads.run(1 + round % 4, [&](unsigned i) {
      std::lock_guard lock(mutex);
      seen[i] = std::this_thread::get_id();
      EXPECT_EQ(seen[i], first[i]) << "index " << i << " moved to another thread in round " << round;
    });
  }
  std::set<std::thread::id> distinct(first.begin(), first.end());
  EXPECT_EQ(distinct.size(), 4u);
  EXPECT_EQ(first[0], std::this_thread::get_id()) << "task 0 is the caller's share";
}

TEST(WorkerThreads, TheFirstExceptionReachesTheCallerAfterAllTasksReturned) {
  detail::WorkerThreads threads(3, "test worker");
  std::atomic<int> returned{0};
  try {
    threads.run(3, [&](unsigned i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * i));
      returned.fetch_add(1);
      if (i == 1) throw std::runtime_error("task 1 failed");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task 1 failed");
  }
  EXPECT_EQ(returned.load(), 3);
  // The threads are fit for the next run.
  std::atomic<int> ran{0};
  threads.run(3, [&](unsigned) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), 3);
}

TEST(WorkerThreads, ThreadsStartOnlyWhenNeeded) {
  // Threads of this process named for the pool below (other tests may leave threads exiting).
  const auto threads_of_process = [] {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream comm(entry.path() / "comm");
      std::string name;
      std::getline(comm, name);
      n += name.starts_with("hbmio-tw");
    }
    return n;
  };
  const int before = threads_of_process();
  EXPECT_EQ(before, 0);
  {
    detail::WorkerThreads threads(16, "tw");
    EXPECT_EQ(threads_of_process(), before);
    threads.run(3, [](unsigned) {});
    EXPECT_EQ(threads_of_process(), before + 2) << "task 0 runs on the caller's thread, 1 and 2 on two started";
  }
  EXPECT_EQ(threads_of_process(), before) << "threads outlived their owner";
}

// Threads of this process named `prefix`... (per /proc/self/task).
int threads_named(std::string_view prefix) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(entry.path() / "comm");
    std::string name;
    std::getline(comm, name);
    n += name.starts_with(prefix);
  }
  return n;
}

// The shared pool's threads, once each has named itself: a thread names itself when it starts
// running, so one that an earlier test's work started a moment ago may not carry its name yet.
int shared_pool_threads() {
  const auto started = static_cast<int>(detail::Executor::shared().threads());
  for (int i = 0; i < 2000 && threads_named("hbmio-pool") < started; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return threads_named("hbmio-pool");
}

// The pool for everything that is not an engine's: every task once, the caller's thread among
// those that run them, on named threads that the pool keeps.
TEST(Executor, RunCallsEveryTaskOnceOnTheCallerAndNamedPoolThreads) {
  const int before = shared_pool_threads();  // the shared pool's, of other tests
  detail::Executor pool;
  std::mutex mutex;
  std::vector<int> calls(200);
  std::set<std::thread::id> ran_on;
  pool.run(calls.size(), 4, [&](std::size_t i) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::lock_guard lock(mutex);
    ++calls[i];
    ran_on.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(std::count(calls.begin(), calls.end(), 1), 200) << "a task ran twice or never";
  EXPECT_TRUE(ran_on.contains(std::this_thread::get_id())) << "the caller takes tasks too";
  EXPECT_LE(ran_on.size(), 4u) << "width 4: the caller and at most 3 pool threads";
  EXPECT_LE(pool.threads(), 3u);
  EXPECT_EQ(threads_named("hbmio-pool"), before + static_cast<int>(pool.threads()));
  pool.shutdown();
  EXPECT_EQ(pool.threads(), 0u);
  EXPECT_EQ(threads_named("hbmio-pool"), before) << "shutdown left a thread running";
  // Work after shutdown starts threads again.
  std::atomic<int> ran{0};
  pool.run(3, 3, [&](std::size_t) { ++ran; });
  EXPECT_EQ(ran.load(), 3);
}

TEST(Executor, AFailedTaskStopsTheRestAndReachesTheCallerAfterTheStartedOnesReturn) {
  detail::Executor pool;
  std::atomic<int> started{0}, returned{0};
  try {
    pool.run(1000, 2, [&](std::size_t i) {
      ++started;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ++returned;
      if (i == 3) throw std::runtime_error("task 3 failed");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task 3 failed");
  }
  EXPECT_EQ(started.load(), returned.load()) << "run returned before a started task did";
  EXPECT_LT(started.load(), 1000) << "tasks not yet started ran after the failure";
}

// A run inside a posted job, with every pool thread busy, must not wait for threads that never
// come: the caller's share finishes it. Here the pool holds one thread, itself running the job.
TEST(Executor, ARunInsideAJobFinishesWhenNoThreadIsFree) {
  detail::Executor pool(1);
  std::atomic<bool> release{false};
  std::vector<detail::Pending<std::size_t>> jobs;
  for (int k = 0; k < 8; ++k)
    jobs.push_back(pool.start([&] {
      std::atomic<std::size_t> sum{0};
      pool.run(100, 16, [&](std::size_t i) { sum += i; });
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return sum.load();
    }));
  release = true;
  for (auto& job : jobs) EXPECT_EQ(job.get(), 4950u);
  EXPECT_EQ(pool.threads(), 1u) << "the bound was not kept";
}

TEST(Executor, StartGivesTheResultOrTheExceptionAndWaitsWhenDropped) {
  detail::Executor pool;
  EXPECT_EQ(pool.start([] { return 42; }).get(), 42);
  auto failing = pool.start([]() -> int { throw Error(errno_code(EIO), {.op = "test job"}, "it failed"); });
  EXPECT_THROW(failing.get(), Error);
  std::atomic<bool> done{false};
  {
    auto slow = pool.start([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      done = true;
    });
  }
  EXPECT_TRUE(done.load()) << "a dropped Pending did not wait for its job";
}

// A child of fork() has none of the parent's threads: the shared pool there starts afresh.
// The progress line both faces show is drawn by a pool job (no thread of the face's own): every
// 200 ms while the transfer runs, a last line and a newline with Ending::keep, nothing left on the
// line with Ending::erase, and nothing at all for a short transfer that erases.
TEST(ProgressLines, DrawnByThePoolUntilStoppedThenKeptOrErased) {
  std::atomic<std::uint64_t> done{0};
  std::mutex mutex;
  std::string text;
  std::set<std::thread::id> writers;
  const auto writer = [&](const std::string& piece) {
    std::lock_guard lock(mutex);
    text += piece;
    writers.insert(std::this_thread::get_id());
  };
  {
    ProgressLine line("load", 4 << 20, done, ProgressLine::Ending::keep, writer);
    done = 1 << 20;
    std::this_thread::sleep_for(std::chrono::milliseconds(450));  // two draws
    done = 4 << 20;
    {
      std::lock_guard lock(mutex);
      EXPECT_NE(text.find("load  1.00 MiB / 4.00 MiB  (25%)  "), std::string::npos) << text;
      EXPECT_FALSE(writers.contains(std::this_thread::get_id())) << "drawn on a pool thread, not the caller's";
    }
    line.stop();
    line.stop();  // idempotent
  }
  ASSERT_TRUE(text.ends_with("\n")) << text;
  const std::string last = text.substr(text.rfind('\r'));
  EXPECT_TRUE(last.starts_with("\rload  4.00 MiB / 4.00 MiB  (100%)  ")) << last;
  EXPECT_NE(last.find(" GiB/s"), std::string::npos) << last;

  text.clear();
  { ProgressLine line("", 1 << 20, done, ProgressLine::Ending::erase, writer); }
  EXPECT_EQ(text, "") << "a short transfer that erases shows nothing";
  text.clear();
  {
    ProgressLine line("", 8 << 20, done, ProgressLine::Ending::erase, writer);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  ASSERT_TRUE(text.starts_with("\r4.00 MiB / 8.00 MiB  (50%)  ")) << text;
  EXPECT_TRUE(text.ends_with("\r\033[K")) << "the line is erased at the end: " << text;
}

TEST(Executor, AForkedChildRunsJobsOnAPoolOfItsOwn) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer cannot start threads in a child of a multi-threaded fork (it dies there); the
  // default and ASan builds run this test.
  GTEST_SKIP() << "ThreadSanitizer does not support threads after a multi-threaded fork";
#endif
  auto& pool = detail::Executor::shared();
  std::atomic<bool> hold{true};
  // Waited for before the test returns: the job reads `hold`, on this frame.
  detail::Pending<void> busy = pool.start([&] {
    while (hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::atomic<int> ran{0};
    detail::Executor::shared().run(4, 4, [&](std::size_t) { ++ran; });
    auto job = detail::Executor::shared().start([] { return 7; });
    ::_exit(ran.load() == 4 && job.get() == 7 ? 0 : 1);
  }
  hold = false;  // the child forked with the pool busy; an early return below must not hang on it
  busy.get();
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit (killed or hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's pool did not run its jobs";
}

TEST(PositionalIo, ShortReadsResumeAndEveryByteArrives) {
  TempDir dir;
  const auto data = random_bytes(1 << 20, 7);
  write_file(dir.file("f"), data);
  const File file = File::open(dir.file("f"), OpenMode::read, false);
  FaultInjector faults(FaultPlan{.seed = 3, .short_probability = 1.0, .eagain_count = 5, .eintr_count = 5});
  std::vector<std::byte> out(data.size() - 100);
  detail::read_exactly(file.fd(), out, 100, {.op = "read", .path = file.path()}, {.faults = &faults});
  EXPECT_EQ(first_mismatch(out, std::vector<std::byte>(data.begin() + 100, data.end())), -1);
  EXPECT_GT(faults.log().size(), 15u) << "the injector cut (almost) nothing short";
}

TEST(PositionalIo, EndOfFileIsReportedWithTheOffset) {
  TempDir dir;
  write_file(dir.file("f"), random_bytes(1000, 1));
  const File file = File::open(dir.file("f"), OpenMode::read, false);
  std::vector<std::byte> out(2000);
  EXPECT_EQ(detail::read_fully(file.fd(), out, 0, {.op = "read", .path = file.path()}), 1000u);
  try {
    detail::read_exactly(file.fd(), out, 0, {.op = "read", .path = file.path()});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EIO));
    EXPECT_NE(std::string(e.what()).find("file ended at byte 1000"), std::string::npos) << e.what();
    EXPECT_EQ(e.context().offset, 1000u);
  }
}

TEST(PositionalIo, EndlessEagainIsAnErrorNotAHang) {
  TempDir dir;
  write_file(dir.file("f"), random_bytes(4096, 1));
  const File file = File::open(dir.file("f"), OpenMode::read, false);
  FaultInjector faults(FaultPlan{.eagain_count = detail::kMaxRetries + 1});
  std::vector<std::byte> out(4096);
  try {
    detail::read_exactly(file.fd(), out, 0, {.op = "read", .path = file.path()}, {.faults = &faults});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EAGAIN));
    EXPECT_NE(std::string(e.what()).find("kept reporting EAGAIN"), std::string::npos) << e.what();
  }
}

TEST(PositionalIo, WritesResumeAndANoProgressWriteIsEnospc) {
  TempDir dir;
  const auto data = random_bytes(300000, 9);
  {
    const File out = File::open(dir.file("w"), OpenMode::write, false);
    FaultInjector faults(FaultPlan{.seed = 5, .short_probability = 0.8});
    detail::write_fully(out.fd(), data, 0, {.op = "write", .path = out.path()}, {.faults = &faults});
  }
  EXPECT_EQ(first_mismatch(pread_range(dir.file("w"), 0, data.size()), data), -1);
  const File out = File::open(dir.file("w"), OpenMode::write, false);
  FaultInjector zero(FaultPlan{.end_of_file_io = 1});  // the first call "moves nothing"
  try {
    detail::write_fully(out.fd(), data, 0, {.op = "write", .path = out.path()}, {.faults = &zero});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(ENOSPC));
  }
}

TEST(PageCache, MincoreCountsARangeLongerThanItsWindowAsCachestatDoes) {
  // mincore is what kernels before 6.5 get; it walks the range in windows of 1,024 pages.
  TempDir dir;
  const std::string path = dir.file("cached");
  write_file(path, random_bytes(std::size_t{9} << 20, 7));  // just written: in the page cache
  const File file = File::open(path, OpenMode::read);
  const std::uint64_t offset = 12345, length = (std::uint64_t{9} << 20) - offset - 1000;
  const detail::Residency m = detail::mincore_residency(file.fd(), offset, length);
  EXPECT_STREQ(m.method, "mincore");
  EXPECT_EQ(m.total_pages, (offset + length + 4095) / 4096 - offset / 4096);
  EXPECT_GT(m.cached_pages, 0u);
  EXPECT_LE(m.cached_pages, m.total_pages);
  const detail::Residency any = detail::page_cache_residency(file.fd(), offset, length);
  EXPECT_EQ(any.total_pages, m.total_pages);
  if (std::string_view(any.method) == "cachestat") EXPECT_EQ(any.cached_pages, m.cached_pages) << "the two methods disagree";
  EXPECT_EQ(detail::mincore_residency(file.fd(), 0, 0).total_pages, 0u);
}

TEST(ErrorBoundary, StandardLibraryErrorsLeaveAsHbmioErrors) {
  const ErrorContext context{.op = "save", .path = "/x/model"};
  try {
    detail::errors_as_hbmio(context, [] { std::filesystem::directory_iterator("/nonexistent/hbmio-dir"); });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(ENOENT));
    EXPECT_EQ(e.context().op, "save");
    EXPECT_EQ(e.context().path, "/nonexistent/hbmio-dir") << "the path the file system named";
  }
  try {
    detail::errors_as_hbmio(context, [] { throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again), "thread"); });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EAGAIN));
    EXPECT_EQ(e.context().path, "/x/model");
  }
  EXPECT_EQ(detail::errors_as_hbmio(context, [] { return 7; }), 7);
}

// `hbmio doctor PATH` names the path the auto backend takes for PATH, because both ask
// choose_auto(); a file on a disk without nvidia-fs (this machine, and the H200 machine) gets uring.
TEST(AutoChoice, TheDoctorSaysWhatAutoPicks) {
  TempDir dir;
  write_file(dir.file("f"), random_bytes(8192, 1));
  const File file = File::open(dir.file("f"), OpenMode::read);
  const detail::AutoChoice choice = detail::choose_auto(file, -1, detail::probe_uring());
  ASSERT_FALSE(choice.backend.empty());
  if (choice.backend != "cufile") EXPECT_NE(choice.passed_over.find("cufile: "), std::string::npos) << choice.passed_over;
  const std::vector<Check> checks = run_doctor({.paths = {dir.file("f")}});
  const auto summary = std::find_if(checks.begin(), checks.end(), [&](const Check& c) { return c.id == "summary.auto:" + dir.file("f"); });
  ASSERT_NE(summary, checks.end());
  EXPECT_EQ(summary->found.rfind("auto: " + choice.backend + " ", 0), 0u) << summary->found << " vs " << choice.backend;
}

TEST(AutoChoice, TheOrderIsDmaCufileThenUringThenPosix) {
  const BackendStatus uring{"uring", true, ""}, no_uring{"uring", false, "io_uring_queue_init failed"};
  const detail::CufileVerdict dma{.usable = true, .direct = true, .mode = "GDS (nvidia-fs 2.26)"};
  const detail::CufileVerdict compat{.usable = true, .direct = false, .mode = "compatibility mode"};
  const detail::CufileVerdict refused{.reason = "no NVMe device (cuFile not asked)"};
  EXPECT_EQ(detail::choose_auto(dma, uring).backend, "cufile");
  EXPECT_EQ(detail::choose_auto(dma, uring).cufile_mode, "GDS (nvidia-fs 2.26)");
  EXPECT_EQ(detail::choose_auto(compat, uring).backend, "uring") << "compatibility mode is a pread + copy";
  EXPECT_EQ(detail::choose_auto(compat, uring).passed_over, "cufile: compatibility mode, no faster than uring");
  EXPECT_EQ(detail::choose_auto(refused, no_uring).backend, "posix");
  EXPECT_EQ(detail::choose_auto(refused, no_uring).passed_over,
            "cufile: no NVMe device (cuFile not asked); uring: io_uring_queue_init failed");
}

// A seed replays the same short transfers at the same bytes whatever the number of workers and
// however their calls interleave, and fail_offset fails the I/O at a place, with any worker count.
TEST(FaultReplay, ASeedReplaysTheSameFaultsWithAnyNumberOfWorkers) {
  TempDir dir;
  const auto data = random_bytes(3 << 20, 11);
  write_file(dir.file("f"), data);
  const auto run = [&](unsigned workers, const FaultPlan& plan) {
    Options options = small_options(DirectIo::off);
    options.workers = workers;
    auto faults = std::make_shared<FaultInjector>(plan);
    auto engine = detail::make_engine_with_faults("uring", options, faults);
    const File file = File::open(dir.file("f"), OpenMode::read);
    Buffer out = Buffer::allocate({MemoryKind::host}, data.size());
    std::string error;
    try {
      engine->read(file, 0, out.span());
      EXPECT_EQ(first_mismatch(to_host(out.span()), data), -1);
    } catch (const Error& e) {
      error = fmt::format("errno {} at byte {}", e.code().value(), e.context().offset);
    }
    auto log = faults->log();
    std::sort(log.begin(), log.end());
    return std::make_pair(log, error);
  };
  const FaultPlan cuts{.seed = 42, .short_probability = 0.3};
  const auto one = run(1, cuts);
  EXPECT_GT(one.first.size(), 3u) << "nothing was cut short";
  for (unsigned workers : {2u, 3u}) {
    // Every I/O that exists with one worker exists with several (same pieces), and is cut alike.
    const auto several = run(workers, cuts);
    EXPECT_EQ(several.first, one.first) << workers << " workers";
    EXPECT_EQ(several.first, run(workers, cuts).first) << workers << " workers, again";
  }
  const FaultPlan place{.fail_errno = EIO, .fail_offset = 2'000'000, .fail_what = "read"};
  const auto failed_one = run(1, place);
  EXPECT_EQ(failed_one.second, fmt::format("errno {} at byte {}", EIO, 1966080)) << "the piece holding byte 2,000,000";
  for (unsigned workers : {2u, 3u}) EXPECT_EQ(run(workers, place).second, failed_one.second) << workers << " workers";
}

TEST(EnginePools, ALeaseIsReusedAndConcurrentLeasesDiffer) {
  EnginePool pool(2);
  Engine* first = nullptr;
  {
    auto a = pool.acquire("posix");
    first = a.get();
    auto b = pool.acquire("posix");
    EXPECT_NE(a.get(), b.get()) << "two leases share one engine";
  }
  EXPECT_EQ(pool.idle_counts().at("posix"), 2u);
  {
    auto again = pool.acquire("posix");
    EXPECT_TRUE(again.get() == first || pool.idle_counts().at("posix") == 1u);
  }
  EXPECT_EQ(pool.release_all(), 2u);
  EXPECT_TRUE(pool.idle_counts().empty());
  EXPECT_THROW(pool.acquire("nonsense"), Error);
}

TEST(EnginePools, EnginesOfAnotherWorkerCountAreKeptApartAndAFullPoolFreesItsOldest) {
  EnginePool pool(2);
  Engine* two = nullptr;
  Engine* configured = nullptr;
  {
    auto a = pool.acquire("posix", 2);
    auto b = pool.acquire("posix");
    two = a.get();
    configured = b.get();
  }
  {
    auto b = pool.acquire("posix");
    EXPECT_EQ(b.get(), configured) << "a lease of the configured size got the 2-worker engine";
    auto a = pool.acquire("posix", 2);
    EXPECT_EQ(a.get(), two);
    auto c = pool.acquire("posix", 3);
    EXPECT_NE(c.get(), two);
    EXPECT_NE(c.get(), configured);
  }
  // Given back in the order c, a, b (destruction reverses declaration): c, the oldest, was freed.
  EXPECT_EQ(pool.idle_counts().at("posix"), 2u);
  {
    auto a = pool.acquire("posix", 2);
    auto b = pool.acquire("posix");
    EXPECT_EQ(a.get(), two);
    EXPECT_EQ(b.get(), configured) << "the newer engines were kept, so the 3-worker one was freed";
  }
  EnginePool none(0);  // keeps nothing: a lease given back is freed
  { auto lease = none.acquire("posix", 2); }
  EXPECT_TRUE(none.idle_counts().empty());
}

TEST(EnginePools, SavesAndLoadsWithoutAnEngineLeaseOneFromTheSharedPool) {
  TempDir dir;
  EnginePool::shared().release_all();
  const auto data = random_bytes(1 << 16, 2);
  save_checkpoint(dir.file("a.safetensors"),
                  {{.name = "t", .dtype = safetensors::Dtype::U8, .shape = {data.size()},
                    .data = {const_cast<std::byte*>(data.data()), data.size(), {}}}},
                  {.backend = "posix"});
  EXPECT_EQ(EnginePool::shared().idle_counts().at("posix"), 1u);
  const LoadedCheckpoint loaded = load_checkpoint(dir.file("a.safetensors"), {.backend = "posix"});
  EXPECT_EQ(EnginePool::shared().idle_counts().at("posix"), 1u) << "the load did not reuse the save's engine";
  EXPECT_EQ(first_mismatch(to_host(loaded.tensors().at(0).data), data), -1);
  EnginePool::shared().release_all();
}

// Public calls on a thread without a current CUDA context leave it without one (no context is
// created on a GPU the caller did not name), and a thread whose current device is another GPU
// keeps it. One GPU shows the first; the second needs two.
class GpuCallerDevice : public testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  }
};

TEST_F(GpuCallerDevice, TransfersLeaveTheCallersContextAsItWas) {
  TempDir dir;
  const auto data = random_bytes(3 << 20, 4);
  write_file(dir.file("f"), data);
  Buffer device = Buffer::allocate({MemoryKind::device, cuda_device_count() - 1}, data.size());
  for (const char* backend : {"posix", "uring", "auto"}) {
    auto engine = make_engine(backend, small_options());
    const File file = File::open(dir.file("f"), OpenMode::read);
    std::thread([&] {
      ASSERT_EQ(cuda::current_device(), -1) << "a new thread has no current context";
      engine->read(file, 0, device.span());
      EXPECT_EQ(cuda::current_device(), -1) << backend << " left a context current on the caller's thread";
      std::vector<std::byte> back(data.size());
      copy_memory({back.data(), back.size(), {}}, device.span());
      EXPECT_EQ(cuda::current_device(), -1) << "copy_memory left a context current";
      EXPECT_EQ(first_mismatch(back, data), -1) << backend;
    }).join();
    if (cuda_device_count() > 1) {
      std::thread([&] {
        cuda::set_device(0, {});
        engine->read(file, 0, device.span());
        EXPECT_EQ(cuda::current_device(), 0) << backend << " changed the caller's current device";
      }).join();
    }
  }
}

}  // namespace
}  // namespace hbmio::test
