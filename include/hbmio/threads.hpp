// The library's threads, seen from outside: engines own theirs; everything else (background
// saves' persists, streams' fills, hashing, remote transfers, multi-location loads) runs on one
// process-wide pool of named threads ("hbmio-pool"). Two calls concern a program's own threads.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>

namespace hbmio {

// Before exit, in a program that used the GPU: waits for the pool's jobs (background saves'
// persists, streams' fills) and joins its threads, then frees the shared engine pool's idle
// engines, while the CUDA runtime is still alive (its teardown runs in exit handlers). Call
// wait_for_all_saves() first to learn whether every background save published, and close the
// streams. Python's hbmio does all of this at interpreter exit. Work started later starts threads
// and engines again.
void shutdown();

// What run_interruptible saw: whether `interrupted` said yes, and what `work` threw (or null).
struct InterruptibleRun {
  bool interrupted = false;
  std::exception_ptr error;
};

// Runs work(stop) on a pool thread while the calling thread asks interrupted() every `poll`, first
// before any wait; the first yes sets `stop`, which `work` hands to the call it makes
// (SaveOptions::cancel, AsyncSaveOptions::cancel, ...) so that it ends at its next safe point.
// Returns once `work` has returned, never earlier: what it references stays valid. How the
// command line stops on SIGINT and Python on Ctrl-C (interrupted() checks the signal there, on the
// thread that must see it).
InterruptibleRun run_interruptible(const std::function<void(const std::atomic<bool>& stop)>& work,
                                   const std::function<bool()>& interrupted,
                                   std::chrono::milliseconds poll = std::chrono::milliseconds(50));

}  // namespace hbmio
