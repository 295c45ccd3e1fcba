// What the files of the Python extension share (python/src/): the module is bound by topic, one
// file each: loads and lazy access (load.cpp), saves and bytes (save.cpp), streams (stream.cpp),
// errors (errors.cpp), the pieces they all use (common.cpp), and the module (hbmio_ext.cpp). The
// binding only binds: queues, threads, planning and signal handling live in the library.
#pragma once

#include <fcntl.h>   // fcntl (F_DUPFD_CLOEXEC)
#include <stdlib.h>  // on_exit
#include <unistd.h>  // _exit

#include <cstdio>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hbmio/async_save.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/config.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "hbmio/progress.hpp"
#include "hbmio/threads.hpp"
#include "hbmio/safetensors.hpp"
#include "hbmio/stream.hpp"
#include "hbmio/version.hpp"

namespace nb = nanobind;

namespace hbmio_py {

using hbmio::safetensors::Dtype;

// The module's exception types (errors.cpp), made at import; they live as long as the module.
extern PyObject* g_error_type;         // hbmio.Error (a subclass of OSError)
extern PyObject* g_not_verified_type;  // hbmio.NotVerifiedWarning (a UserWarning)
extern PyObject* g_verify_error_type;  // hbmio.VerifyError (a subclass of hbmio.Error)

// The error for a tensor whose dtype the binding hands out in no form (F6_*): op "convert to
// DLPack", which translate() raises as hbmio.DtypeError (a TypeError, and a SafetensorError where
// safetensors is installed: the reference's safe_open refuses such a tensor with
// SafetensorError("Dtype not understood: F6_E2M3")).
constexpr const char* kDtypeOp = "convert to DLPack";

// Dtypes and devices between safetensors and DLPack (common.cpp).
nb::dlpack::dtype to_dlpack(Dtype d, const std::string& name);
std::vector<std::size_t> dlpack_shape(Dtype d, const std::vector<std::uint64_t>& shape, const std::string& name);
std::optional<Dtype> from_dlpack(nb::dlpack::dtype t);
bool packed_f4(nb::dlpack::dtype t);
hbmio::MemoryLocation parse_device(std::string text);
int dlpack_device_type(const hbmio::MemoryLocation& where);

// array_api: an object with __dlpack__, __dlpack_device__ and the buffer protocol (nanobind.nb_ndarray).
using Array = nb::ndarray<nb::array_api>;

// An engine borrowed from the library's shared pool (hbmio::EnginePool) for one call, so repeated
// loads skip the set-up; returned on every path, errors included. The idle engines keep their
// rings and pinned buffers until _release_engines() (registered with atexit by hbmio/__init__.py,
// while the CUDA runtime is still alive).
class EngineLease {
 public:
  explicit EngineLease(const std::string& backend) : lease_(hbmio::EnginePool::shared().acquire(backend)) {}
  hbmio::Engine* get() const noexcept { return lease_.get(); }

 private:
  hbmio::EnginePool::Lease lease_;
};

// Bytes done so far, which the engine adds to while Python (another thread, holding the GIL
// only to read it) draws a progress bar.
struct Progress {
  std::atomic<std::uint64_t> done{0};
  std::unique_ptr<hbmio::ProgressLine> line;  // while Python's progress=True shows the bar (_show)

  Progress() = default;
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  // Called with the GIL held (Python drops the object): a bar still shown is stopped without it,
  // as _hide does, since its drawing job takes the GIL to write and stop() waits for that job.
  ~Progress() { hide(); }
  void hide() {
    if (!line) return;
    std::unique_ptr<hbmio::ProgressLine> shown = std::move(line);
    nb::gil_scoped_release release;
    shown.reset();
  }
};

// verify=: False/None (off), True or "checksums" (files without checksums load, with a
// NotVerifiedWarning naming them), "strict" (such files are an error before anything is read).
struct VerifyMode {
  bool verify = false;
  bool strict = false;
};

VerifyMode verify_mode(nb::handle value);
// With the GIL held: warns that files without checksums were loaded unchecked.
void warn_unverified(const hbmio::LoadedCheckpoint& loaded);
hbmio::LoadOptions load_options(const std::string& backend, VerifyMode verify, std::optional<std::vector<std::string>> names,
                                Progress* progress, const std::string& cache = "");
// Python's cache= as the library's CacheUse: "" (None: HBMIO_CACHE decides), "off", "use", "add".
hbmio::CacheUse cache_use(const std::string& cache);
// Stats as Python sees them: report= dicts and stats dicts.
nb::list paths_list(const std::vector<hbmio::TransferPath>& paths);
void fill_stats(nb::dict into, const hbmio::Stats& s);
void report_into(nb::handle report, const hbmio::Stats& s);
nb::dict stats_dict(const hbmio::Stats& s);

// Any array taken whole as a byte range: `what` names the call for error messages. Arrays must be
// C-contiguous (a strided array's bytes are not one range), and on the host or a CUDA device.
struct RawArray {
  nb::ndarray<nb::ro> array;  // keeps the producer's memory alive while the GIL is released
  hbmio::MemorySpan span;
};
RawArray raw_array(nb::handle value, bool writable, const char* what);

// For hbmio::run_interruptible, from a thread that released the GIL: takes it to ask whether a
// signal came (save.cpp). The exception (KeyboardInterrupt for Ctrl-C) stays set, for the caller to
// raise once the work has ended.
bool interrupted_by_signal();

// hbmio.DtypeError (errors.cpp).
PyObject* dtype_error_type();

// Each topic's classes and functions onto the module.
void bind_errors(nb::module_& m);
void bind_load(nb::module_& m);
void bind_save(nb::module_& m);
void bind_stream(nb::module_& m);

}  // namespace hbmio_py
