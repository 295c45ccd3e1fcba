// hbmio._hbmio: the Python extension (nanobind) over the public C++ API.
//
// Results are framework-neutral DLPack arrays (nb::ndarray without a framework): NumPy, PyTorch,
// CuPy and JAX take them with from_dlpack without a copy. Lifetime: one load makes one
// LoadedCheckpoint, owned by one capsule; every array of that load holds a reference to the
// capsule, so the memory is freed exactly when the last array using it is gone (no close()).
// The GIL is released around every call that does I/O.
//
// Engines (io_uring rings, worker threads, pinned bounce buffers) take tens of milliseconds to set
// up, more than a small load takes, so loads, saves and raw reads/writes borrow one from the
// library's pool (hbmio::EnginePool) instead of making their own; see EngineLease.
#include <fcntl.h>   // fcntl (F_DUPFD_CLOEXEC)
#include <stdlib.h>  // on_exit
#include <unistd.h>  // _exit

#include <cstdio>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
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
#include "hbmio/threads.hpp"
#include "hbmio/safetensors.hpp"
#include "hbmio/stream.hpp"
#include "hbmio/version.hpp"

namespace nb = nanobind;
using hbmio::safetensors::Dtype;

namespace {

PyObject* g_error_type = nullptr;  // hbmio.Error (a subclass of OSError); lives as long as the module
PyObject* g_not_verified_type = nullptr;  // hbmio.NotVerifiedWarning (a UserWarning), held by the module
PyObject* g_verify_error_type = nullptr;  // hbmio.VerifyError (a subclass of hbmio.Error), held by the module

// Subclasses of hbmio.Error that are also the OSError subclass Python itself raises for an errno
// value (FileNotFoundError for ENOENT, ...): code written for safetensors or open() catches
// FileNotFoundError, code written for hbmio catches hbmio.Error, and both catch the same failure.
struct ErrnoType {
  int err;
  const char* name;    // hbmio.<name>
  PyObject** builtin;  // the second base (the address: Python's exception objects are set at run time)
  PyObject* type = nullptr;  // made at module init; EACCES and EPERM share one
};
ErrnoType g_errno_types[] = {
    {ENOENT, "FileNotFoundError", &PyExc_FileNotFoundError},
    {EACCES, "PermissionError", &PyExc_PermissionError},
    {EPERM, "PermissionError", &PyExc_PermissionError},
    {EISDIR, "IsADirectoryError", &PyExc_IsADirectoryError},
    {ENOTDIR, "NotADirectoryError", &PyExc_NotADirectoryError},
    {EEXIST, "FileExistsError", &PyExc_FileExistsError},
};

// DLPack type codes (dlpack.h, v1.1). Raw numbers, so older nanobind releases (without the
// float8 enumerators) build too.
enum : std::uint8_t {
  kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6,
  kFloat8_e4m3fn = 10, kFloat8_e4m3fnuz = 11, kFloat8_e5m2 = 12, kFloat8_e5m2fnuz = 13, kFloat8_e8m0fnu = 14,
  kFloat4_e2m1fn = 17,
};

nb::dlpack::dtype dl(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes = 1) { return {code, bits, lanes}; }

// The error for a tensor whose dtype the binding hands out in no form (F6_*): op "convert to
// DLPack", which translate() raises as hbmio.DtypeError (a TypeError, and a SafetensorError where
// safetensors is installed: the reference's safe_open refuses such a tensor with
// SafetensorError("Dtype not understood: F6_E2M3")).
constexpr const char* kDtypeOp = "convert to DLPack";

// safetensors dtype -> DLPack dtype. F8_E4M3 is torch.float8_e4m3fn (what safetensors writes for
// it), hence DLPack's e4m3fn. F4 is handed out packed, two values a byte, as torch's
// float4_e2m1fn_x2 is and as torch exports it through DLPack (e2m1fn, 4 bits, 2 lanes): the
// reference's torch tensors of F4 are of that dtype, their last dimension half the file's (see
// dlpack_shape). F6 (four values in three bytes) has no such form in DLPack or torch.
nb::dlpack::dtype to_dlpack(Dtype d, const std::string& name) {
  switch (d) {
    case Dtype::F4: return dl(kFloat4_e2m1fn, 4, 2);
    case Dtype::BOOL: return dl(kBool, 8);
    case Dtype::U8: return dl(kUInt, 8);
    case Dtype::I8: return dl(kInt, 8);
    case Dtype::F8_E5M2: return dl(kFloat8_e5m2, 8);
    case Dtype::F8_E4M3: return dl(kFloat8_e4m3fn, 8);
    case Dtype::F8_E8M0: return dl(kFloat8_e8m0fnu, 8);
    case Dtype::F8_E4M3FNUZ: return dl(kFloat8_e4m3fnuz, 8);
    case Dtype::F8_E5M2FNUZ: return dl(kFloat8_e5m2fnuz, 8);
    case Dtype::I16: return dl(kInt, 16);
    case Dtype::U16: return dl(kUInt, 16);
    case Dtype::F16: return dl(kFloat, 16);
    case Dtype::BF16: return dl(kBfloat, 16);
    case Dtype::I32: return dl(kInt, 32);
    case Dtype::U32: return dl(kUInt, 32);
    case Dtype::F32: return dl(kFloat, 32);
    case Dtype::C64: return dl(kComplex, 64);
    case Dtype::F64: return dl(kFloat, 64);
    case Dtype::I64: return dl(kInt, 64);
    case Dtype::U64: return dl(kUInt, 64);
    default: break;
  }
  throw hbmio::Error(hbmio::errno_code(ENOTSUP), {.op = kDtypeOp},
                     "Dtype not understood: " + std::string(hbmio::safetensors::to_string(d)) + " (tensor " + name +
                         ": neither DLPack nor torch has this packed sub-byte type)");
}

// The DLPack shape of a tensor of the file's `shape`: the same, except for F4, whose last
// dimension counts pairs (the reference's torch shape: safetensors 0.8 and 0.9 load F4 [2, 6] as
// float4_e2m1fn_x2 [2, 3], and refuse an odd last dimension with these words).
std::vector<std::size_t> dlpack_shape(Dtype d, const std::vector<std::uint64_t>& shape, const std::string& name) {
  std::vector<std::size_t> out(shape.begin(), shape.end());
  if (d != Dtype::F4) return out;
  if (out.empty() || out.back() % 2 != 0) {
    std::string text;
    for (auto n : shape) text += (text.empty() ? "" : ", ") + std::to_string(n);
    throw hbmio::Error(hbmio::errno_code(EINVAL), {.op = kDtypeOp},
                       "f4_x2 dtype requires that the last dim be divisible by 2 in torch: got [" + text + "] (tensor " +
                           name + ")");
  }
  out.back() /= 2;
  return out;
}

std::optional<Dtype> from_dlpack(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  switch (t.code) {
    case kBool: if (t.bits == 8) return Dtype::BOOL; break;
    case kUInt:
      switch (t.bits) { case 8: return Dtype::U8; case 16: return Dtype::U16; case 32: return Dtype::U32; case 64: return Dtype::U64; }
      break;
    case kInt:
      switch (t.bits) { case 8: return Dtype::I8; case 16: return Dtype::I16; case 32: return Dtype::I32; case 64: return Dtype::I64; }
      break;
    case kFloat:
      switch (t.bits) { case 16: return Dtype::F16; case 32: return Dtype::F32; case 64: return Dtype::F64; }
      break;
    case kBfloat: if (t.bits == 16) return Dtype::BF16; break;
    case kComplex: if (t.bits == 64) return Dtype::C64; break;
    case kFloat8_e4m3fn: if (t.bits == 8) return Dtype::F8_E4M3; break;
    case kFloat8_e5m2: if (t.bits == 8) return Dtype::F8_E5M2; break;
    case kFloat8_e8m0fnu: if (t.bits == 8) return Dtype::F8_E8M0; break;
    case kFloat8_e4m3fnuz: if (t.bits == 8) return Dtype::F8_E4M3FNUZ; break;
    case kFloat8_e5m2fnuz: if (t.bits == 8) return Dtype::F8_E5M2FNUZ; break;
  }
  return std::nullopt;
}

// torch.float4_e2m1fn_x2 as torch exports it (e2m1fn, 4 bits, 2 lanes): F4, two values a byte.
bool packed_f4(nb::dlpack::dtype t) { return t.code == kFloat4_e2m1fn && t.bits == 4 && t.lanes == 2; }

// "cpu" / "host" -> host memory, "pinned", "cuda" -> cuda:0, "cuda:N".
hbmio::MemoryLocation parse_device(std::string text) {
  for (auto& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (text == "cpu") return {};
  if (text == "cuda") return {hbmio::MemoryKind::device, 0};
  return hbmio::MemoryLocation::parse(text);
}

int dlpack_device_type(const hbmio::MemoryLocation& where) {
  return where.kind == hbmio::MemoryKind::device ? nb::device::cuda::value : nb::device::cpu::value;
}

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
};

// verify=: False/None (off), True or "checksums" (files without checksums load, with a
// NotVerifiedWarning naming them), "strict" (such files are an error before anything is read).
struct VerifyMode {
  bool verify = false;
  bool strict = false;
};

VerifyMode verify_mode(nb::handle value) {
  if (value.is_none()) return {};
  if (nb::isinstance<nb::bool_>(value)) return {nb::cast<bool>(value), false};
  if (nb::isinstance<nb::str>(value)) {
    const std::string text = nb::cast<std::string>(value);
    if (text == "checksums") return {true, false};
    if (text == "strict") return {true, true};
  }
  throw nb::value_error(("verify must be False, True (\"checksums\") or \"strict\", not " +
                         nb::cast<std::string>(nb::repr(value)))
                            .c_str());
}

// With the GIL held: warns that files without checksums were loaded unchecked. A filter that turns
// warnings into errors makes it raise.
void warn_unverified(const hbmio::LoadedCheckpoint& loaded) {
  const auto& files = loaded.unverified_files();
  if (files.empty()) return;
  const std::string text =
      "not verified: " + std::to_string(files.size()) + " file(s) hold no hbmio checksums (" + files.front() +
      (files.size() > 1 ? " and " + std::to_string(files.size() - 1) + " more" : std::string()) +
      "); their tensors were loaded unchecked (add checksums with `hbmio ckpt checksum`, or pass verify=\"strict\" "
      "to refuse such files)";
  if (PyErr_WarnEx(g_not_verified_type, text.c_str(), 2) != 0) throw nb::python_error();
}

hbmio::LoadOptions load_options(const std::string& backend, VerifyMode verify, std::optional<std::vector<std::string>> names,
                                Progress* progress) {
  hbmio::LoadOptions options;
  options.backend = backend;
  options.verify = verify.verify;
  options.require_checksums = verify.strict;
  if (names) options.names = std::move(*names);
  if (progress) options.progress = &progress->done;
  return options;
}

// Stats::paths as Python sees them: [{file, path, reason, bytes, bytes_direct}], `path` one of
// "gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix", "remote".
nb::list paths_list(const std::vector<hbmio::TransferPath>& paths) {
  nb::list out;
  for (const hbmio::TransferPath& p : paths) {
    nb::dict d;
    d["file"] = p.file;
    d["path"] = std::string(hbmio::to_string(p.path));
    d["reason"] = p.reason;
    d["bytes"] = p.bytes;
    d["bytes_direct"] = p.bytes_direct;
    out.append(d);
  }
  return out;
}

// Writes a transfer's figures into `into`: the report= of loads and saves, and stats dicts.
void fill_stats(nb::dict into, const hbmio::Stats& s) {
  into["bytes"] = s.bytes;
  into["seconds"] = s.seconds;
  into["gib_per_second"] = s.gib_per_second();
  into["backend"] = s.backend;
  into["bytes_direct"] = s.bytes_direct;
  into["note"] = s.note;
  into["paths"] = paths_list(s.paths);
}

// report=: None, or a dict the call fills with what its transfer did (fill_stats).
void report_into(nb::handle report, const hbmio::Stats& s) {
  if (report.is_none()) return;
  if (!nb::isinstance<nb::dict>(report)) throw nb::type_error("report= takes a dict to fill (or None)");
  fill_stats(nb::borrow<nb::dict>(report), s);
}

// Loads and wraps every tensor as a DLPack array owned by one capsule.
nb::dict load(const std::string& path, const std::string& device, const std::string& backend, nb::handle verify,
              std::optional<std::vector<std::string>> names, Progress* progress, nb::handle report) {
  hbmio::LoadOptions options = load_options(backend, verify_mode(verify), std::move(names), progress);
  options.into = parse_device(device);
  auto* loaded = new hbmio::LoadedCheckpoint();
  try {
    nb::gil_scoped_release release;
    EngineLease engine(backend);
    options.engine = engine.get();
    *loaded = hbmio::load_checkpoint(path, options);
  } catch (...) {
    delete loaded;
    throw;
  }
  // From here the capsule owns the checkpoint (its destructor runs when the last array goes).
  nb::capsule owner(loaded, [](void* p) noexcept { delete static_cast<hbmio::LoadedCheckpoint*>(p); });
  warn_unverified(*loaded);
  report_into(report, loaded->stats());
  nb::dict result;
  for (const auto& t : loaded->tensors()) {
    std::vector<std::size_t> shape = dlpack_shape(t.dtype, t.shape, t.name);
    Array array(t.data.data, shape.size(), shape.data(), owner, nullptr, to_dlpack(t.dtype, t.name),
                dlpack_device_type(t.data.location), t.data.location.kind == hbmio::MemoryKind::device ? t.data.location.device : 0);
    result[nb::str(t.name.c_str(), t.name.size())] = nb::cast(array, nb::rv_policy::reference);
  }
  return result;
}

// Any array taken whole as a byte range: `what` names the call for error messages. Arrays must be
// C-contiguous (a strided array's bytes are not one range), and on the host or a CUDA device.
struct RawArray {
  nb::ndarray<nb::ro> array;  // keeps the producer's memory alive while the GIL is released
  hbmio::MemorySpan span;
};

RawArray raw_array(nb::handle value, bool writable, const char* what) {
  RawArray out;
  if (writable) {
    nb::ndarray<> rw;
    if (!nb::try_cast(value, rw, false)) {
      nb::ndarray<nb::ro> ro;
      if (nb::try_cast(value, ro, false))
        throw nb::value_error((std::string(what) + ": the array is read-only; it needs a writable one").c_str());
      throw nb::type_error((std::string(what) + ": expected an array supporting DLPack or the buffer protocol, got " +
                            nb::type_name(value.type()).c_str()).c_str());
    }
    out.array = nb::ndarray<nb::ro>(rw);
  } else if (!nb::try_cast(value, out.array, false)) {
    throw nb::type_error((std::string(what) + ": expected an array supporting DLPack or the buffer protocol, got " +
                          nb::type_name(value.type()).c_str()).c_str());
  }
  const auto& a = out.array;
  std::int64_t expected = 1;
  // Strides of dimensions of extent 1 do not matter, nor any stride of an empty array.
  for (std::size_t i = a.ndim(); i-- > 0 && a.size() > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw nb::value_error((std::string(what) + ": the array is not C-contiguous (its bytes are not one range); "
                                                 "pass a contiguous array").c_str());
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  if (a.dtype().bits % 8 != 0 || a.dtype().lanes != 1)
    throw nb::type_error((std::string(what) + ": arrays of sub-byte or vector dtypes are not supported").c_str());
  hbmio::MemoryLocation where;
  if (a.device_type() == nb::device::cuda::value) {
    where = {hbmio::MemoryKind::device, a.device_id()};
  } else if (a.device_type() != nb::device::cpu::value && a.device_type() != nb::device::cuda_host::value) {
    throw nb::type_error((std::string(what) + ": arrays on DLPack device type " + std::to_string(a.device_type()) +
                          " are not supported").c_str());
  }
  out.span = {static_cast<std::byte*>(const_cast<void*>(a.data())), a.nbytes(), where};
  return out;
}

nb::dict stats_dict(const hbmio::Stats& s) {
  nb::dict d;
  fill_stats(d, s);
  return d;
}

// What the reads of one SafeOpen did, summed over them: its report().
struct ReadReport {
  std::mutex mutex;
  hbmio::Stats total;
  std::uint64_t reads = 0;  // batches read
  void add(const hbmio::Stats& s) {
    std::lock_guard lock(mutex);
    total.add_part(s);
    total.seconds += s.seconds;
    ++reads;
  }
};

struct Handle {
  // Shared with the read-ahead's reader (ReadQueue), which may outlive the Python object.
  std::shared_ptr<const hbmio::OpenedCheckpoint> checkpoint;
  std::shared_ptr<ReadReport> report = std::make_shared<ReadReport>();  // shared with the reader too

  const std::string& path() const noexcept { return checkpoint->path(); }
  const std::vector<hbmio::CheckpointFile>& files() const noexcept { return checkpoint->files(); }
  std::size_t index(const std::string& name) const {
    if (const auto i = checkpoint->find(name)) return *i;
    throw nb::key_error(("no tensor named '" + name + "' in " + path()).c_str());
  }
  const hbmio::safetensors::TensorInfo& info(const std::string& name) const { return *checkpoint->tensors()[index(name)].info; }
};

// Reads of parts of tensors of a SafeOpen into arrays: indices into tensors(), destinations, and
// optional byte offsets and lengths within each tensor (default: the whole tensor). The spans are
// taken here, with the GIL held; the reads then need no Python object. With `location` ("cpu",
// "cuda:N"), each destination is the address of memory there (torch's data_ptr()), which the
// caller keeps alive and large enough for the read: a walk of thousands of tensors then skips a
// DLPack export per tensor, a noticeable part of the walk's time per tensor (bench/RESULTS.md,
// "Lazy access").
std::vector<hbmio::TensorRead> tensor_reads(const hbmio::OpenedCheckpoint& checkpoint, const std::vector<std::size_t>& indices, const nb::list& dests,
                                            const std::optional<std::vector<std::uint64_t>>& offsets,
                                            const std::optional<std::vector<std::uint64_t>>& lengths,
                                            const std::optional<std::string>& location) {
  if (dests.size() != indices.size() || (offsets && offsets->size() != indices.size()) || (lengths && lengths->size() != indices.size()))
    throw nb::value_error("_read: one destination (and offset and length, where given) per tensor");
  const std::optional<hbmio::MemoryLocation> at =
      location ? std::optional(hbmio::MemoryLocation::parse(*location)) : std::nullopt;
  std::vector<hbmio::TensorRead> reads(indices.size());
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] >= checkpoint.tensors().size()) throw nb::index_error("_read: tensor index out of range");
    const std::uint64_t size = checkpoint.tensors()[indices[i]].info->size();
    reads[i].tensor = indices[i];
    reads[i].offset = offsets ? (*offsets)[i] : 0;
    reads[i].length = lengths ? (*lengths)[i] : size;
    // A tensor of no bytes may come with an empty array, whose pointer may be null: nothing to read.
    if (reads[i].length == 0) continue;
    if (at) {
      const auto address = nb::cast<std::uintptr_t>(dests[i]);
      if (address == 0) throw nb::value_error("_read: a null destination address");
      reads[i].into = {reinterpret_cast<std::byte*>(address), static_cast<std::size_t>(reads[i].length), *at};
    } else {
      reads[i].into = raw_array(dests[i], true, "_read").span;
    }
  }
  return reads;
}

// The read-ahead's reader: one thread and one engine reading batches of a SafeOpen's tensors in
// the order they are queued, so the next batch starts the moment the one before it ends (no gap
// while Python collects, and no second engine competing for the cores: measured on the GPU
// machine, two batches read at once through two engines made a walk of 128 MiB tensors slower).
// Python queues a batch with the arrays it reads into (kept alive here until the batch is
// waited for, or the queue is gone) and waits for it by its number. Dropping the queue skips
// the batches not started and waits for the one being read.
// hbmio.stream's engine: a BatchStream whose batches become DLPack views of its ring. Each view
// holds the stream (a capsule owning a shared_ptr), so the ring outlives every view of it; what a
// view shows is overwritten once the batch after it is asked for (hbmio/_stream.py documents it).
class PyStream {
 public:
  PyStream(std::vector<std::string> files, hbmio::StreamOptions options)
      : stream_(std::make_shared<hbmio::BatchStream>(std::move(files), std::move(options))) {}

  // (epoch, index, records, last_of_epoch, [arrays]) or None after the last batch.
  nb::object next(std::uintptr_t cuda_stream) {
    std::optional<hbmio::Batch> batch;
    {
      nb::gil_scoped_release release;
      batch = stream_->next(reinterpret_cast<void*>(cuda_stream));
    }
    if (!batch) return nb::none();
    const auto& fields = stream_->fields();
    nb::capsule owner(new std::shared_ptr<hbmio::BatchStream>(stream_),
                      [](void* p) noexcept { delete static_cast<std::shared_ptr<hbmio::BatchStream>*>(p); });
    nb::list arrays;
    for (std::size_t f = 0; f < fields.size(); ++f) {
      std::vector<std::size_t> shape{static_cast<std::size_t>(batch->records)};
      shape.insert(shape.end(), fields[f].record_shape.begin(), fields[f].record_shape.end());
      const hbmio::MemorySpan& span = batch->fields[f];
      Array array(span.data, shape.size(), shape.data(), owner, nullptr, to_dlpack(fields[f].dtype, fields[f].name),
                  dlpack_device_type(span.location), span.location.kind == hbmio::MemoryKind::device ? span.location.device : 0);
      arrays.append(nb::cast(array, nb::rv_policy::reference));
    }
    return nb::make_tuple(batch->epoch, batch->index, batch->records, batch->last_of_epoch, arrays);
  }

  nb::list fields() {
    const std::vector<hbmio::StreamField>* fields = nullptr;
    {
      nb::gil_scoped_release release;
      fields = &stream_->fields();
    }
    nb::list out;
    for (const auto& f : *fields)
      out.append(nb::make_tuple(f.name, std::string(hbmio::safetensors::to_string(f.dtype)), f.record_shape, f.record_bytes));
    return out;
  }

  std::tuple<std::uint64_t, std::uint64_t> sizes() {
    nb::gil_scoped_release release;
    const std::uint64_t records = stream_->records_per_epoch();
    return {records, stream_->batch_records()};
  }

  static nb::dict to_dict(const hbmio::StreamStats& s) {
    nb::dict d;
    d["epoch"] = s.epoch;
    d["batches"] = s.batches;
    d["records"] = s.records;
    d["bytes"] = s.bytes;
    d["seconds"] = s.seconds;
    d["read_seconds"] = s.read_seconds;
    d["wait_seconds"] = s.wait_seconds;
    d["records_per_second"] = s.records_per_second();
    d["gib_per_second"] = s.gib_per_second();
    return d;
  }
  nb::dict stats() const { return to_dict(stream_->stats()); }

  // position() as a dict (hbmio/_stream.py makes it the state_dict): pool as [first, end, ...].
  nb::dict position() {
    hbmio::StreamPosition p;
    {
      nb::gil_scoped_release release;
      p = stream_->position();
    }
    nb::dict d;
    d["epoch"] = p.epoch;
    std::vector<std::uint64_t> pool;
    for (const auto& [a, b] : p.pool) {
      pool.push_back(a);
      pool.push_back(b);
    }
    d["pool"] = pool;
    d["world"] = p.world;
    d["batches"] = p.batches;
    d["fingerprint"] = p.fingerprint;
    d["fields"] = p.fields;
    d["batch_records"] = p.batch_records;
    return d;
  }
  std::string fingerprint() {
    nb::gil_scoped_release release;
    return stream_->fingerprint();
  }
  static hbmio::StreamPosition position_of(const nb::dict& d) {
    hbmio::StreamPosition p;
    p.epoch = nb::cast<std::uint64_t>(d["epoch"]);
    const auto pool = nb::cast<std::vector<std::uint64_t>>(d["pool"]);
    if (pool.size() % 2 != 0) throw nb::value_error("a stream state's pool is pairs of positions");
    for (std::size_t i = 0; i < pool.size(); i += 2) p.pool.emplace_back(pool[i], pool[i + 1]);
    p.world = nb::cast<unsigned>(d["world"]);
    p.batches = nb::cast<std::vector<std::uint64_t>>(d["batches"]);
    p.fingerprint = nb::cast<std::string>(d["fingerprint"]);
    p.fields = nb::cast<std::string>(d["fields"]);
    p.batch_records = nb::cast<std::uint64_t>(d["batch_records"]);
    p.seed = nb::cast<std::uint64_t>(d["seed"]);
    p.shuffle_window = nb::cast<std::uint64_t>(d["shuffle_window"]);
    p.shuffle = nb::cast<bool>(d["shuffle"]);
    p.drop_last = nb::cast<bool>(d["drop_last"]);
    return p;
  }

  nb::list epoch_stats() const {
    nb::list out;
    for (const auto& s : stream_->epoch_stats()) out.append(to_dict(s));
    return out;
  }
  void close() {
    nb::gil_scoped_release release;
    stream_->close();
  }

 private:
  std::shared_ptr<hbmio::BatchStream> stream_;
};

hbmio::ShardFormat shard_format(const std::string& text) {
  if (text == "auto") return hbmio::ShardFormat::automatic;
  if (text == "npy") return hbmio::ShardFormat::npy;
  if (text == "safetensors") return hbmio::ShardFormat::safetensors;
  if (text == "raw") return hbmio::ShardFormat::raw;
  throw nb::value_error(("format must be 'auto', 'npy', 'safetensors' or 'raw', not '" + text + "'").c_str());
}

// The read-ahead's reader (hbmio::ReadQueue, which reads on the library's pool), holding each
// batch's destination arrays until the batch is waited for.
class ReadQueue {
 public:
  ReadQueue(const Handle& h, const std::string& backend)
      : queue_(std::in_place, h.checkpoint, backend, [report = h.report](const hbmio::Stats& s) { report->add(s); }) {}
  ~ReadQueue() {
    {
      nb::gil_scoped_release release;
      queue_.reset();  // waits for the batch being read
    }
    keep_.clear();  // with the GIL held: it drops the arrays
  }
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;
  const hbmio::OpenedCheckpoint& checkpoint() const noexcept { return queue_->checkpoint(); }

  std::uint64_t push(std::vector<hbmio::TensorRead> reads, nb::object keep) {
    const std::uint64_t id = queue_->push(std::move(reads));
    keep_.emplace(id, std::move(keep));
    return id;
  }

  // Waits for batch `id`; raises its read's error. Each batch is waited for once.
  void wait(std::uint64_t id) {
    std::exception_ptr error;
    {
      nb::gil_scoped_release release;
      try {
        queue_->wait(id);
      } catch (...) {
        error = std::current_exception();
      }
    }
    keep_.erase(id);  // the GIL is held again: dropping the arrays is safe
    if (error) std::rethrow_exception(error);
  }

 private:
  std::optional<hbmio::ReadQueue> queue_;
  std::map<std::uint64_t, nb::object> keep_;  // touched with the GIL held only
};

// A load's checkpoint: a path, or a SafeOpen (Handle) whose headers were read already, so a caller
// that plans, allocates and loads parses them once.
struct Target {
  std::string path;
  const std::vector<hbmio::CheckpointFile>* files = nullptr;
};
Target target_of(nb::handle h) {
  if (nb::isinstance<Handle>(h)) {
    const Handle& handle = nb::cast<const Handle&>(h);
    return {handle.path(), &handle.files()};
  }
  return {nb::cast<std::string>(h), nullptr};
}

// Loads into the caller's memory (`dest`, e.g. a torch.empty(n, dtype=uint8) from PyTorch's
// caching allocator, so repeated loads reuse device memory as safetensors.torch does). Returns,
// per tensor in file order, (name, dtype, shape, byte offset in dest); the caller builds views.
// With entries=False it returns None: a caller that has the layout from _plan (of the same
// SafeOpen) skips building thousands of tuples.
nb::object load_into(nb::handle checkpoint, nb::handle dest, const std::string& backend, nb::handle verify,
                     std::optional<std::vector<std::string>> names, Progress* progress, bool entries, nb::handle report) {
  const Target target = target_of(checkpoint);
  RawArray to = raw_array(dest, true, "_load_into");
  hbmio::LoadOptions options = load_options(backend, verify_mode(verify), std::move(names), progress);
  // The load's location is the destination's: they cannot disagree. A host destination gets the
  // host kind (a cuda_host array may be pinned, but the engine only needs to know it is host).
  options.into = to.span.location;
  options.destination = to.span;
  // A null destination means "allocate your own" to load_checkpoint, and an empty array may have
  // a null pointer: callers allocate at least one byte (max(load_size, 1)).
  if (to.span.data == nullptr || to.span.size == 0) throw nb::value_error("_load_into: the destination must hold at least 1 byte");
  hbmio::LoadedCheckpoint loaded;
  {
    nb::gil_scoped_release release;
    EngineLease engine(backend);
    options.engine = engine.get();
    loaded = target.files ? hbmio::load_checkpoint_files(target.path, *target.files, options)
                          : hbmio::load_checkpoint(target.path, options);
  }
  warn_unverified(loaded);
  report_into(report, loaded.stats());
  if (!entries) return nb::none();
  nb::list out;
  for (const auto& t : loaded.tensors()) {
    const auto offset = static_cast<std::size_t>(t.data.data - to.span.data);
    nb::list shape;
    for (auto n : t.shape) shape.append(n);
    out.append(nb::make_tuple(t.name, std::string(hbmio::safetensors::to_string(t.dtype)), shape, offset));
  }
  return out;
}

// Bytes [offset, offset + nbytes) of the file into the array (the whole of it).
nb::dict read_into(const std::string& path, nb::handle array, std::uint64_t offset, const std::string& backend,
                   Progress* progress) {
  RawArray to = raw_array(array, true, "read_into");
  hbmio::Stats stats;
  {
    nb::gil_scoped_release release;
    hbmio::File file = hbmio::File::open(path, hbmio::OpenMode::read);
    EngineLease engine(backend);
    stats = engine.get()->submit({.op = hbmio::IoOp::read, .file = &file, .offset = offset, .memory = to.span,
                                  .progress = progress ? &progress->done : nullptr});
  }
  return stats_dict(stats);
}

// The array's bytes into the file at `offset`. read_write mode: creates a missing file and keeps
// the bytes outside the range (write mode would truncate).
nb::dict write_from(const std::string& path, nb::handle array, std::uint64_t offset, const std::string& backend,
                    bool sync, Progress* progress) {
  RawArray from = raw_array(array, false, "write_from");
  hbmio::Stats stats;
  {
    nb::gil_scoped_release release;
    hbmio::File file = hbmio::File::open(path, hbmio::OpenMode::read_write);
    EngineLease engine(backend);
    stats = engine.get()->submit({.op = hbmio::IoOp::write, .file = &file, .offset = offset, .memory = from.span,
                                  .progress = progress ? &progress->done : nullptr});
    if (sync) file.sync();
  }
  return stats_dict(stats);
}

// True when the array's bytes are one range in C order (strides of dimensions of extent 1 do not
// matter, nor any stride of an empty array).
bool c_contiguous(const nb::ndarray<nb::ro>& a) {
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0 && a.size() > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

// The bytes an array's elements occupy, [begin, end), on its DLPack device; strides may be
// negative (NumPy's reversed views). None for an array of no bytes, which shares nothing.
struct Extent {
  std::int32_t device_type = 0, device_id = 0;
  std::uintptr_t begin = 0, end = 0;
  std::size_t index = 0;  // of the tensor, in the order given
};
std::optional<Extent> extent_of(const nb::ndarray<nb::ro>& a, std::size_t index) {
  if (a.size() == 0 || a.data() == nullptr) return std::nullopt;
  std::int64_t low = 0, high = 0;  // in elements, from data()
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    const std::int64_t reach = (static_cast<std::int64_t>(a.shape(i)) - 1) * a.stride(i);
    (reach < 0 ? low : high) += reach;
  }
  const auto item = static_cast<std::int64_t>(a.itemsize());
  const auto base = reinterpret_cast<std::uintptr_t>(a.data());
  return Extent{a.device_type(), a.device_id(), base + static_cast<std::uintptr_t>(low * item),
                base + static_cast<std::uintptr_t>((high + 1) * item), index};
}

// The tensors of a save (or of save() to bytes): each array held alive and C-contiguous while
// the GIL is released, and what the format needs of it.
struct SaveInput {
  std::vector<nb::ndarray<nb::ro>> keep;
  std::vector<hbmio::TensorToSave> list;
};

// {name: array} as given, each array as its own memory (no conversion), before anything is copied
// or written. Refuses a key that is not a str (TypeError naming it) and tensors whose bytes overlap
// (RuntimeError naming them, as safetensors refuses them: written twice, they would load as
// separate tensors). `where` names the destination in messages.
struct Gathered {
  std::vector<std::string> names;
  std::vector<nb::handle> values;  // borrowed from the caller's dict, which outlives the call
  std::vector<nb::ndarray<nb::ro>> views;
  std::vector<bool> viewed;  // false: not an array without conversion (pack_tensors says what it is)
};
Gathered gather_tensors(nb::dict tensors, const std::string& where) {
  Gathered g;
  std::vector<Extent> extents;
  for (auto [key, value] : tensors) {
    std::string name;
    if (!nb::isinstance<nb::str>(key) || !nb::try_cast(key, name, false))
      throw nb::type_error(("save to " + where + ": tensor names must be str; the key " + std::string(nb::repr(key).c_str()) +
                            " (" + nb::type_name(key.type()).c_str() + ") is not").c_str());
    nb::ndarray<nb::ro> view;
    const bool ok = nb::try_cast(value, view, false);
    if (ok)
      if (auto extent = extent_of(view, g.names.size())) extents.push_back(*extent);
    g.names.push_back(std::move(name));
    g.values.push_back(value);
    g.views.push_back(std::move(view));
    g.viewed.push_back(ok);
  }
  // Overlapping ranges on one device, grouped: sorted by start, a range that starts before the
  // group's furthest end joins the group.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.device_type, a.device_id, a.begin) < std::tie(b.device_type, b.device_id, b.begin);
  });
  std::vector<std::vector<std::string>> shared;
  for (std::size_t i = 0; i < extents.size();) {
    std::size_t j = i + 1;
    std::uintptr_t end = extents[i].end;
    for (; j < extents.size() && extents[j].device_type == extents[i].device_type &&
           extents[j].device_id == extents[i].device_id && extents[j].begin < end; ++j)
      end = std::max(end, extents[j].end);
    if (j - i > 1) {
      std::vector<std::string> group;
      for (std::size_t k = i; k < j; ++k) group.push_back(g.names[extents[k].index]);
      std::sort(group.begin(), group.end());
      shared.push_back(std::move(group));
    }
    i = j;
  }
  if (!shared.empty()) {
    std::sort(shared.begin(), shared.end());
    std::string listed;
    for (const auto& group : shared) {
      listed += listed.empty() ? "[" : ", [";
      for (std::size_t k = 0; k < group.size(); ++k) listed += (k ? ", '" : "'") + group[k] + "'";
      listed += "]";
    }
    throw std::runtime_error(
        "save to " + where + ": some tensors share memory: " + listed +
        ". Written as they are, each would be stored twice and load again as separate tensors, no longer "
        "shared. Save one name per memory: hbmio.torch.save_model(model, path) keeps one name of each group "
        "and records the others in the metadata (hbmio.torch.load_model ties them again), or save copies "
        "(.clone()). See https://huggingface.co/docs/safetensors/torch_shared_tensors");
  }
  return g;
}

// The gathered arrays as a save takes them: strided ones copied (by their own framework, through
// nanobind's converting cast) into C order; a value that is no array is a TypeError naming it.
SaveInput pack_tensors(Gathered g) {
  using Contiguous = nb::ndarray<nb::ro, nb::c_contig>;
  SaveInput out;
  out.keep.reserve(g.names.size());
  for (std::size_t i = 0; i < g.names.size(); ++i) {
    const std::string& name = g.names[i];
    nb::ndarray<nb::ro> array = std::move(g.views[i]);
    if (!g.viewed[i] || !c_contiguous(array)) {
      Contiguous packed;
      if (!nb::try_cast(g.values[i], packed, true))
        throw nb::type_error(("tensor " + name + ": expected an array supporting DLPack or the buffer protocol, got " +
                              nb::type_name(g.values[i].type()).c_str()).c_str());
      array = nb::ndarray<nb::ro>(packed);
    }
    auto dtype = packed_f4(array.dtype()) ? std::optional<Dtype>(Dtype::F4) : from_dlpack(array.dtype());
    if (!dtype) {
      throw nb::type_error(("tensor " + name + ": DLPack dtype (code " + std::to_string(array.dtype().code) + ", " +
                            std::to_string(array.dtype().bits) + " bits) has no safetensors equivalent").c_str());
    }
    hbmio::MemoryLocation location;
    if (array.device_type() == nb::device::cuda::value) {
      location = {hbmio::MemoryKind::device, array.device_id()};
    } else if (array.device_type() != nb::device::cpu::value && array.device_type() != nb::device::cuda_host::value) {
      throw nb::type_error(("tensor " + name + ": arrays on DLPack device type " +
                            std::to_string(array.device_type()) + " are not supported").c_str());
    }
    hbmio::TensorToSave t;
    t.name = name;
    t.dtype = *dtype;
    for (std::size_t d = 0; d < array.ndim(); ++d) t.shape.push_back(array.shape(d));
    if (t.dtype == Dtype::F4) {
      // The file counts F4 values, torch pairs of them: the last dimension doubles, as the
      // reference writes float4_e2m1fn_x2 [2, 3] as F4 [2, 6]. A scalar holds one pair, which
      // no F4 shape says; the reference refuses it with these words.
      if (t.shape.empty())
        throw hbmio::Error(hbmio::errno_code(EINVAL), {.op = kDtypeOp},
                           "Error while serializing: The slice is slicing for subbytes dtypes, and the slice does not end up "
                           "at a byte boundary, this is invalid. (tensor " + name + ": a float4_e2m1fn_x2 scalar)");
      t.shape.back() *= 2;
    }
    // nanobind's nbytes() leaves lanes out (4 bits an element): an F4 pair is one byte.
    const std::size_t nbytes = t.dtype == Dtype::F4 ? array.size() : array.nbytes();
    t.data = {static_cast<std::byte*>(const_cast<void*>(array.data())), nbytes, location};
    out.list.push_back(std::move(t));
    out.keep.push_back(std::move(array));
  }
  return out;
}

SaveInput collect_tensors(nb::dict tensors, const std::string& where) { return pack_tensors(gather_tensors(tensors, where)); }

// The options save_file's keywords give, blocking or not.
hbmio::SaveOptions save_options(std::optional<std::map<std::string, std::string>> metadata, bool checksums,
                                const std::string& backend, std::uint64_t max_shard_size) {
  hbmio::SaveOptions options;
  if (metadata) {
    // Given, even empty, the entry is written: the reference writes "__metadata__":{} for
    // metadata={} and nothing for None.
    options.metadata = std::move(*metadata);
    options.empty_metadata = hbmio::safetensors::EmptyMetadata::write;
  }
  options.checksums = checksums;
  options.backend = backend;
  options.max_shard_size = max_shard_size;
  return options;
}

// For run_interruptible, from a thread that released the GIL: takes it to ask whether a signal
// came (Python's handler only sets a flag, which PyErr_CheckSignals turns into the exception,
// KeyboardInterrupt for Ctrl-C). The exception stays set, raised by the caller once the work ended.
bool interrupted_by_signal() {
  nb::gil_scoped_acquire acquire;
  return PyErr_CheckSignals() != 0;
}

void save(nb::dict tensors, const std::string& path, std::optional<std::map<std::string, std::string>> metadata,
          bool checksums, const std::string& backend, std::uint64_t max_shard_size, Progress* progress, nb::handle report) {
  SaveInput input = collect_tensors(tensors, path);
  const std::vector<hbmio::TensorToSave>& list = input.list;
  hbmio::SaveOptions options = save_options(std::move(metadata), checksums, backend, max_shard_size);
  if (progress) options.progress = &progress->done;
  // The save runs on the library's pool while this thread checks for Ctrl-C every 50 ms (Python's
  // handler only sets a flag, which PyErr_CheckSignals turns into KeyboardInterrupt). On one the
  // save stops before it publishes (SaveOptions::cancel), removing what it wrote, and the
  // KeyboardInterrupt is raised once it has: `path` then holds what it held before. A save that
  // had published already finishes, and the KeyboardInterrupt follows it.
  hbmio::Stats stats;
  hbmio::InterruptibleRun run;
  {
    nb::gil_scoped_release release;
    run = hbmio::run_interruptible(
        [&](const std::atomic<bool>& stop) {
          options.cancel = &stop;
          stats = hbmio::save_checkpoint(path, list, options);
        },
        interrupted_by_signal);
  }
  if (run.interrupted) throw nb::python_error();  // ECANCELED, or a failure: the KeyboardInterrupt says it all
  if (run.error) std::rethrow_exception(run.error);
  report_into(report, stats);
}

// A background save (hbmio.save_file(..., blocking=False)). Dropping it does not wait: the save
// goes on, and hbmio's exit handler waits for every save still in flight (wait_for_all_saves).
struct BackgroundSave {
  hbmio::SaveInProgress save;
  explicit BackgroundSave(hbmio::SaveInProgress s) : save(std::move(s)) {}
  ~BackgroundSave() { save.detach(); }

  bool done() const { return save.done(); }
  // Waits up to `timeout` seconds (None: no limit); true once the save has finished. Ctrl-C raises
  // KeyboardInterrupt and leaves the save running.
  bool wait(std::optional<double> timeout) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout.value_or(0));
    for (;;) {
      bool finished;
      {
        nb::gil_scoped_release release;
        finished = save.wait_for(std::chrono::milliseconds(50));
      }
      if (finished) return true;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (timeout && std::chrono::steady_clock::now() >= until) return false;
    }
  }
  // Raises the error of a finished save (hbmio.Error and its subclasses, as a synchronous save).
  void result() {
    nb::gil_scoped_release release;
    (void)save.wait();
  }
  nb::dict report() const {
    const hbmio::AsyncSaveReport r = save.report();
    nb::dict d;
    d["snapshot_seconds"] = r.snapshot_seconds;
    d["stalled_seconds"] = r.stalled_seconds;
    d["persist_seconds"] = r.persist_seconds;
    d["staged_bytes"] = r.staged_bytes;
    d["staging"] = r.staging == hbmio::Staging::device ? "device" : "pinned";
    d["paths"] = paths_list(r.paths);  // empty until durable
    return d;
  }
};

std::unique_ptr<BackgroundSave> save_async(nb::dict tensors, const std::string& path,
                                           std::optional<std::map<std::string, std::string>> metadata, bool checksums,
                                           const std::string& backend, std::uint64_t max_shard_size, const std::string& staging,
                                           std::uint64_t pool_bytes, bool wait_if_busy) {
  SaveInput input = collect_tensors(tensors, path);
  const hbmio::SaveOptions options = save_options(std::move(metadata), checksums, backend, max_shard_size);
  hbmio::AsyncSaveOptions async;
  if (staging == "device") {
    async.staging = hbmio::Staging::device;
  } else if (staging != "pinned") {
    throw nb::value_error(("staging must be 'pinned' or 'device', not '" + staging + "'").c_str());
  }
  async.pool_bytes = pool_bytes;
  async.wait_if_busy = wait_if_busy;
  // The snapshot (copies out of the arrays, which `input` keeps alive) blocks while a state larger
  // than the pool waits for the writer to drain it, or while an earlier save of the path finishes:
  // it runs on a thread of its own while this one checks for Ctrl-C every 50 ms, as a blocking save
  // does. On one the snapshot stops (AsyncSaveOptions::cancel), or, if it had just finished, the
  // save is cancelled (SaveInProgress::cancel); either way it stops before it publishes, and the
  // KeyboardInterrupt is raised once it has: `path` then holds what it held before. A save that had
  // published already finishes, and the KeyboardInterrupt follows it.
  std::optional<hbmio::SaveInProgress> started;
  hbmio::InterruptibleRun run;
  {
    nb::gil_scoped_release release;
    // interrupted_by_signal is asked before the first wait: a Ctrl-C that came while the arrays
    // were collected stops the snapshot before its first copy.
    run = hbmio::run_interruptible(
        [&](const std::atomic<bool>& stop) {
          async.cancel = &stop;
          started.emplace(hbmio::save_checkpoint_async(path, input.list, options, async));
        },
        interrupted_by_signal);
  }
  if (!run.interrupted && PyErr_CheckSignals() != 0) run.interrupted = true;  // one during the last copies
  if (run.interrupted) {
    if (started) {
      started->cancel();
      nb::gil_scoped_release release;
      try {
        (void)started->wait();
      } catch (const hbmio::Error&) {  // ECANCELED, or a failure: the KeyboardInterrupt says it all
      }
    }
    throw nb::python_error();
  }
  if (run.error) std::rethrow_exception(run.error);
  return std::make_unique<BackgroundSave>(std::move(*started));
}

// Safetensors bytes in memory (hbmio.torch.save/load, as safetensors.torch.save/load): the
// format code of the files (serialize_header, parse_header), so bytes and files are written in
// the same layout and read under the same checks, with no file in between.
constexpr const char* kBytesName = "safetensors bytes";

// {name: host array} -> the bytes of a safetensors file: header as the reference writer makes it
// (its tensor order, its padding), then the tensors back to back.
nb::bytes serialize(nb::dict tensors, std::optional<std::map<std::string, std::string>> metadata) {
  SaveInput input = collect_tensors(tensors, kBytesName);
  std::vector<hbmio::safetensors::TensorInfo> infos;
  std::unordered_map<std::string, const hbmio::TensorToSave*> by_name;
  for (const auto& t : input.list) {
    if (t.data.location.kind == hbmio::MemoryKind::device)
      throw nb::value_error(("tensor " + t.name + " is in GPU memory: bytes are made from host memory; move it there first").c_str());
    infos.push_back({.name = t.name, .dtype = t.dtype, .shape = t.shape});
    by_name[t.name] = &t;
  }
  hbmio::safetensors::order_like_reference(infos);
  // metadata={} writes "__metadata__":{}, None writes no entry: the reference's bytes for each.
  const std::string header = hbmio::safetensors::serialize_header(
      infos, metadata ? *metadata : std::map<std::string, std::string>{},
      metadata ? hbmio::safetensors::EmptyMetadata::write : hbmio::safetensors::EmptyMetadata::omit);
  const std::uint64_t total = header.size() + (infos.empty() ? 0 : infos.back().end);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (out == nullptr) throw nb::python_error();
  nb::bytes result = nb::steal<nb::bytes>(out);
  char* at = PyBytes_AS_STRING(out);
  {
    nb::gil_scoped_release release;  // the bytes object is not visible to anyone else yet
    std::memcpy(at, header.data(), header.size());
    for (const auto& info : infos)
      if (info.size() > 0) std::memcpy(at + header.size() + info.begin, by_name.at(info.name)->data.data, info.size());
  }
  return result;
}

// The validated header of safetensors bytes (anything with the buffer protocol): ([(name, dtype,
// shape, byte offset in `data`, bytes)] in data order, metadata or None).
nb::tuple deserialize(nb::handle data) {
  RawArray in = raw_array(data, false, "load");
  if (in.span.location.kind == hbmio::MemoryKind::device) throw nb::type_error("load: the bytes must be in host memory");
  const auto* bytes = in.span.data;
  const std::uint64_t size = in.span.size;
  const std::uint64_t length = hbmio::safetensors::parse_header_length(bytes, size, kBytesName);
  const hbmio::safetensors::Header header = hbmio::safetensors::parse_header(
      std::string_view(reinterpret_cast<const char*>(bytes) + 8, length), size, kBytesName);
  nb::list entries;
  for (const auto& t : header.tensors) {
    nb::list shape;
    for (auto n : t.shape) shape.append(n);
    entries.append(nb::make_tuple(t.name, std::string(hbmio::safetensors::to_string(t.dtype)), shape,
                                  header.data_offset + t.begin, t.size()));
  }
  nb::object metadata = header.metadata.empty() ? nb::none() : nb::cast(header.metadata);
  return nb::make_tuple(entries, metadata);
}

// Copies bytes [offsets[i], offsets[i] + size of dests[i]) of `data` into each (host) destination.
void copy_bytes(nb::handle data, const std::vector<std::uint64_t>& offsets, const nb::list& dests) {
  if (offsets.size() != dests.size()) throw nb::value_error("_copy_bytes: one offset per destination");
  RawArray from = raw_array(data, false, "load");
  std::vector<RawArray> to;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    to.push_back(raw_array(dests[i], true, "load"));
    const auto& span = to.back().span;
    if (from.span.location.kind == hbmio::MemoryKind::device || span.location.kind == hbmio::MemoryKind::device)
      throw nb::type_error("load: bytes are copied between host arrays only");
    if (offsets[i] > from.span.size || span.size > from.span.size - offsets[i])
      throw nb::value_error("_copy_bytes: a range lies outside the data");
  }
  nb::gil_scoped_release release;
  for (std::size_t i = 0; i < offsets.size(); ++i) std::memcpy(to[i].span.data, from.span.data + offsets[i], to[i].span.size);
}

// The Python type for an error: hbmio.Error, or its subclass for the errno value.
PyObject* error_type_for(int err) {
  for (const auto& t : g_errno_types)
    if (t.err == err) return t.type;
  return g_error_type;
}

// A subclass of hbmio.Error (and of `also`, where not null) that is, where safetensors is
// installed, a safetensors.SafetensorError too, which is what the reference raises for the same
// failure: code written for it (`except SafetensorError`) catches hbmio's too. Made at first use,
// so that safetensors is imported only when such an error happens; hbmio.Error where it cannot be.
PyObject* reference_error_type(const char* name, PyObject* also, const char* doc) {
  nb::list bases;
  bases.append(nb::handle(g_error_type));
  if (also != nullptr) bases.append(nb::handle(also));
  if (PyObject* module = PyImport_ImportModule("safetensors")) {
    if (PyObject* reference = PyObject_GetAttrString(module, "SafetensorError")) bases.append(nb::steal(reference));
    Py_DECREF(module);
  }
  PyErr_Clear();  // without safetensors: no third base
  PyObject* type = PyErr_NewExceptionWithDoc(name, doc, nb::tuple(bases).ptr(), nullptr);
  if (type == nullptr) {
    PyErr_Clear();
    return g_error_type;
  }
  return type;
}

// hbmio.HeaderError: a malformed safetensors header or index.
PyObject* header_error_type() {
  static PyObject* type = nullptr;  // lives as long as the process, as the module's types do
  if (type == nullptr)
    type = reference_error_type("hbmio.HeaderError", nullptr,
                                "A malformed safetensors header or index (hbmio.Error; also safetensors.SafetensorError "
                                "where safetensors is installed).");
  return type;
}

// hbmio.DtypeError: a tensor whose dtype the binding cannot hand out (F6_*) or take (a scalar
// float4_e2m1fn_x2), or an F4 shape torch cannot hold. A TypeError, as hbmio raised for a dtype
// before, and a SafetensorError, as the reference raises for these ("Dtype not understood: ...").
PyObject* dtype_error_type() {
  static PyObject* type = nullptr;
  if (type == nullptr)
    type = reference_error_type("hbmio.DtypeError", PyExc_TypeError,
                                "A dtype or shape of a tensor that cannot be converted (hbmio.Error and TypeError; also "
                                "safetensors.SafetensorError where safetensors is installed).");
  return type;
}

// Raises `type`(args) with hbmio's attributes; a failure of the constructor stays set instead.
void raise_error(PyObject* type, nb::object args, const hbmio::Error* e) {
  PyObject* instance = PyObject_CallObject(type, args.ptr());
  if (!instance) return;
  nb::object inst = nb::steal(instance);
  if (e != nullptr) {
    nb::setattr(inst, "op", nb::str(e->context().op.c_str()));
    nb::setattr(inst, "path", nb::str(e->context().path.c_str()));
    nb::setattr(inst, "backend", nb::str(e->context().backend.c_str()));
    nb::setattr(inst, "detail", nb::str(e->detail().c_str()));
    // OSError.filename, as open() sets it: what `except FileNotFoundError as e: e.filename` reads.
    if (!e->context().path.empty()) nb::setattr(inst, "filename", nb::str(e->context().path.c_str()));
  }
  PyErr_SetObject(type, instance);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const hbmio::Error& e) {
    const auto& category = e.code().category();
    // errno where the code is one, or maps to one (default_error_condition: a category of
    // hbmio's own may say which errno value its code stands for); None for CUDA and cuFile codes.
    int err = 0;
    if (category == std::generic_category() || category == std::system_category()) {
      err = e.code().value();
    } else if (const auto condition = e.code().default_error_condition(); condition.category() == std::generic_category()) {
      err = condition.value();
    }
    // A failed verification is a finding about the data, which callers tell apart from a failed
    // read: its own type (errno stays EIO, what the category maps it to).
    const bool verify_failed =
        category == hbmio::hbmio_category() && e.code().value() == static_cast<int>(hbmio::Errc::verify_failed);
    const bool malformed = e.context().op.starts_with("parse safetensors");
    PyObject* type = verify_failed                ? g_verify_error_type
                     : malformed                  ? header_error_type()
                     : e.context().op == kDtypeOp ? dtype_error_type()
                     : err != 0                   ? error_type_for(err)
                                                  : g_error_type;
    std::string text = e.what();
    if (err == ENOENT && e.context().op == "open checkpoint") {
      // The reference's words for a missing checkpoint ("No such file or directory: notafile"),
      // which code written for it matches on; the file is named as the caller named it.
      text = std::generic_category().message(ENOENT) + ": " + e.context().path;
      if (!e.detail().empty()) text += " (" + e.detail() + ")";
    }
    nb::object args = err != 0 ? nb::make_tuple(err, text) : nb::make_tuple(text);
    raise_error(type, args, &e);
  } catch (const std::system_error& e) {
    // std::thread's failure (EAGAIN) said only "Resource temporarily unavailable".
    if (e.code() != std::errc::resource_unavailable_try_again) throw;
    raise_error(g_error_type, nb::make_tuple(e.code().value(), hbmio::thread_limit_message(e)), nullptr);
  }
}

// hbmio.Error.__str__: "[Errno N] message" without OSError's ": 'filename'" tail (the message
// names the file already), and the message alone where there is no errno.
PyObject* error_str(PyObject* self, PyObject*) {
  nb::handle h(self);
  nb::object err = nb::getattr(h, "errno", nb::none());
  nb::object text = nb::getattr(h, "strerror", nb::none());
  if (!err.is_none() && !text.is_none()) return PyUnicode_FromFormat("[Errno %S] %S", err.ptr(), text.ptr());
  nb::tuple args = nb::borrow<nb::tuple>(nb::getattr(h, "args"));
  if (args.size() == 1) return PyObject_Str(args[0].ptr());
  return reinterpret_cast<PyTypeObject*>(PyExc_OSError)->tp_str(self);
}
PyMethodDef g_error_str_def = {"__str__", error_str, METH_NOARGS, nullptr};

// Makes hbmio.Error, hbmio.VerifyError and the errno subclasses, as attributes of `m`.
void make_error_types(nb::module_& m) {
  g_error_type = PyErr_NewExceptionWithDoc(
      "hbmio.Error",
      "An hbmio failure: the C++ message (operation, file, offset, backend, system message). A subclass of "
      "OSError; errno is set when the failure has an errno value (None for CUDA and cuFile codes), and "
      "filename to the file it concerns. Where Python has an OSError subclass for the errno value, the "
      "error is also one: hbmio.FileNotFoundError is both hbmio.Error and FileNotFoundError (likewise "
      "PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError).",
      PyExc_OSError, nullptr);
  if (g_error_type == nullptr) throw nb::python_error();
  PyObject* str = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(g_error_type), &g_error_str_def);
  if (str == nullptr || PyObject_SetAttrString(g_error_type, "__str__", str) != 0) throw nb::python_error();
  Py_DECREF(str);
  m.attr("Error") = nb::handle(g_error_type);
  // A type named hbmio.NAME with `bases` (a type or a tuple of them), held by the module as long as
  // it lives; the raw pointer is what the translator raises.
  const auto make_type = [&m](const char* name, const char* doc, PyObject* bases) {
    const std::string qualified = std::string("hbmio.") + name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
    if (type == nullptr) throw nb::python_error();
    m.attr(name) = nb::steal(type);
    return type;
  };
  g_verify_error_type = make_type(
      "VerifyError",
      "hbmio.Error for a verification that failed: a stored checksum, a byte comparison or a header check "
      "did not match what was read (verify=True). errno is EIO.",
      g_error_type);
  g_not_verified_type = make_type(
      "NotVerifiedWarning",
      "verify=True loaded files that hold no hbmio checksums (any file another tool wrote): their tensors "
      "were not checked. verify=\"strict\" refuses such files instead.",
      PyExc_UserWarning);
  for (auto& t : g_errno_types) {
    if (nb::hasattr(m, t.name)) {  // EPERM: the type made for EACCES
      t.type = m.attr(t.name).ptr();
      continue;
    }
    nb::tuple bases = nb::make_tuple(nb::handle(g_error_type), nb::handle(*t.builtin));
    const std::string doc = std::string("hbmio.Error that is also ") + t.name + ".";
    t.type = make_type(t.name, doc.c_str(), bases.ptr());
  }
}

}  // namespace

NB_MODULE(_hbmio, m) {
  m.doc() = "hbmio: tensor data between storage and host/GPU memory (safetensors, DLPack)";
  m.attr("__version__") = hbmio::version();

  make_error_types(m);
  nb::register_exception_translator(translate);

  nb::class_<Progress>(m, "_Progress", "Bytes done so far by the call it is passed to (progress=...).")
      .def(nb::init<>())
      .def_prop_ro("done", [](const Progress& p) { return p.done.load(std::memory_order_relaxed); });

  m.def("load_file", &load, nb::arg("path"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify").none() = false, nb::arg("names") = nb::none(), nb::arg("progress").none() = nb::none(),
        nb::arg("report").none() = nb::none(),
        "Loads a .safetensors file, a sharded *.index.json or a directory holding either into `device` "
        "(\"cpu\", \"pinned\", \"cuda\", \"cuda:N\"). Returns {name: DLPack array} in file order. `report`, a "
        "dict, is filled with bytes, seconds, backend, note and paths (per file: the way it took and why).");

  m.def("_load_into", &load_into, nb::arg("checkpoint"), nb::arg("dest"), nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify").none() = false, nb::arg("names") = nb::none(), nb::arg("progress").none() = nb::none(),
        nb::arg("entries") = true, nb::arg("report").none() = nb::none(),
        "Loads `checkpoint` (a path, or a SafeOpen: its headers are not read again) into `dest` (a writable "
        "C-contiguous array, host or CUDA, that holds _plan()'s layout: last offset + bytes); "
        "returns [(name, dtype, shape, byte offset in dest)] in file order.");

  m.def("_tensor_bytes", [](const std::string& path, std::optional<std::vector<std::string>> names) {
    // The bytes a load reads (what its progress counter reaches), without alignment padding.
    std::vector<hbmio::CheckpointFile> files;
    {
      nb::gil_scoped_release release;
      files = hbmio::open_checkpoint(path);
    }
    std::uint64_t total = 0;
    for (const auto& f : files)
      for (const auto& t : f.header.tensors)
        if (!names || std::find(names->begin(), names->end(), t.name) != names->end()) total += t.size();
    return total;
  }, nb::arg("path"), nb::arg("names") = nb::none());

  // One tensor of a load's plan (hbmio::PlannedTensor), by name: where it lands in the load's one
  // allocation. Python reads it as the library made it, never by position.
  nb::class_<hbmio::PlannedTensor>(m, "_PlannedTensor")
      .def_ro("name", &hbmio::PlannedTensor::name)
      .def_prop_ro("dtype", [](const hbmio::PlannedTensor& t) { return std::string(hbmio::safetensors::to_string(t.dtype)); })
      .def_prop_ro("shape", [](const hbmio::PlannedTensor& t) {
        nb::list shape;
        for (auto n : t.shape) shape.append(n);
        return shape;
      })
      .def_ro("size", &hbmio::PlannedTensor::size, "bytes")
      .def_ro("offset", &hbmio::PlannedTensor::memory_offset, "byte offset in the load's allocation")
      .def("__repr__", [](const hbmio::PlannedTensor& t) {
        return "<PlannedTensor " + t.name + " " + std::string(hbmio::safetensors::to_string(t.dtype)) + " " +
               std::to_string(t.size) + " B at " + std::to_string(t.memory_offset) + ">";
      });

  m.def("_plan", [](nb::handle checkpoint, std::optional<std::vector<std::string>> names) {
    const Target target = target_of(checkpoint);
    // The tensors a load takes, in the order it lays them out, and where each lands in the single
    // allocation: [(name, dtype, shape, bytes, offset)]. Distributed loads split this list among
    // ranks (hbmio/distributed.py) and must agree on the layout: it comes from here, not a copy.
    hbmio::LoadOptions options;
    if (names) options.names = std::move(*names);
    std::vector<hbmio::PlannedTensor> plan;
    {
      nb::gil_scoped_release release;
      // ENOENT for a name it does not hold
      plan = target.files ? hbmio::plan_load_files(target.path, *target.files, options) : hbmio::plan_load(target.path, options);
    }
    return plan;
  }, nb::arg("checkpoint"), nb::arg("names") = nb::none(),
     "A PlannedTensor (name, dtype, shape, size, offset) per tensor a load of `checkpoint` (a path or a SafeOpen) takes, in its layout.");

  m.def("_plan_distributed", [](nb::handle checkpoint, std::optional<std::vector<std::string>> names, int world,
                                 const std::string& placement, std::map<std::string, int> shard_map, nb::handle verify) {
    // hbmio::plan_distributed: the plan the C++ NCCL load uses, so torch.distributed loads split,
    // check shard maps and agree exactly as it does. Returns (plan as _plan gives it, the rank that
    // reads each tensor, each rank's (begin, end) of the layout, the digest the ranks compare).
    const Target target = target_of(checkpoint);
    if (placement != "shard" && placement != "replicate")
      throw hbmio::Error(hbmio::errno_code(EINVAL), {.op = "plan a distributed load", .path = target.path},
                         "placement must be 'replicate' or 'shard', not '" + placement + "'");
    hbmio::LoadOptions options;
    if (names) options.names = std::move(*names);
    const VerifyMode mode = verify_mode(verify);
    options.verify = mode.verify;
    options.require_checksums = mode.strict;
    hbmio::DistributedPlan plan;
    {
      nb::gil_scoped_release release;
      const std::vector<hbmio::CheckpointFile> opened = target.files ? std::vector<hbmio::CheckpointFile>{} : hbmio::open_checkpoint(target.path);
      plan = hbmio::plan_distributed(target.path, target.files ? *target.files : opened, options, world,
                                     placement == "shard" ? hbmio::Placement::shard : hbmio::Placement::replicate, shard_map);
    }
    nb::list ranges;
    for (const auto& [begin, end] : plan.range) ranges.append(nb::make_tuple(begin, end));
    char digest[17];
    std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(plan.digest));
    return nb::make_tuple(plan.tensors, plan.reader, ranges, std::string(digest));
  }, nb::arg("checkpoint"), nb::arg("names").none(), nb::arg("world"), nb::arg("placement"), nb::arg("shard_map"), nb::arg("verify").none(),
     "hbmio::plan_distributed: (plan, reader per tensor, (begin, end) per rank, digest).");

  m.def("_read_into", &read_into, nb::arg("path"), nb::arg("array"), nb::arg("offset") = 0, nb::kw_only(),
        nb::arg("backend") = "auto", nb::arg("progress").none() = nb::none());
  m.def("_write_from", &write_from, nb::arg("path"), nb::arg("array"), nb::arg("offset") = 0, nb::kw_only(),
        nb::arg("backend") = "auto", nb::arg("sync") = true, nb::arg("progress").none() = nb::none());

  m.def("_release_engines", [] {
    nb::gil_scoped_release release;
    return hbmio::EnginePool::shared().release_all();
  }, "Frees the idle engines that loads keep for reuse (their rings, threads and pinned buffers); "
     "returns how many. Engines in use by a running call go back to the pool when it ends.");
  m.def("_shutdown", [] {
    nb::gil_scoped_release release;
    hbmio::shutdown();
  }, "At exit, while the CUDA runtime is alive: waits for the library's background jobs, joins its "
     "threads and frees the idle engines (hbmio::shutdown).");
  m.def("_idle_engines", [] { return hbmio::EnginePool::shared().idle_counts(); }, "{backend: idle engines kept for reuse}.");

  m.def("save_file", &save, nb::arg("tensors"), nb::arg("path"), nb::arg("metadata") = nb::none(), nb::kw_only(),
        nb::arg("checksums") = true, nb::arg("backend") = "auto", nb::arg("max_shard_size") = 0,
        nb::arg("progress").none() = nb::none(), nb::arg("report").none() = nb::none(),
        "Writes {name: array} (anything supporting DLPack or the buffer protocol, host or CUDA) as a "
        "safetensors file, crash-safe (temporary file, fsync, rename, directory fsync). `report`, a dict, is "
        "filled as load_file's.");

  nb::class_<BackgroundSave>(m, "BackgroundSave",
                             "A save running in the background (hbmio.save_file(..., blocking=False)).")
      .def("done", &BackgroundSave::done, "True once the save is durable or has failed.")
      .def("_wait", &BackgroundSave::wait, nb::arg("timeout").none())
      .def("_result", &BackgroundSave::result)
      .def("_report", &BackgroundSave::report)
      .def_prop_ro("path", [](const BackgroundSave& b) { return b.save.path(); });
  m.def("_save_file_async", &save_async, nb::arg("tensors"), nb::arg("path"), nb::arg("metadata").none(), nb::kw_only(),
        nb::arg("checksums"), nb::arg("backend"), nb::arg("max_shard_size"), nb::arg("staging"), nb::arg("pool_bytes"),
        nb::arg("wait_if_busy"));
  m.def("_wait_for_all_saves", [] {
    nb::gil_scoped_release release;
    return hbmio::wait_for_all_saves();
  }, "Waits for every background save; returns 'path: error' for those that failed unseen.");
  m.def("_fail_exit_status", [] {
    // Python decides its exit status before the C runtime's exit() runs, and an exit handler of
    // Python's cannot change it; a handler of the C runtime's sees it and may end the process with
    // another, after Python has run every exit handler of its own and flushed its streams. Only a
    // status of 0 becomes 1: a process already failing keeps its own.
    static std::once_flag registered;
    std::call_once(registered, [] {
      ::on_exit([](int status, void*) {
        if (status != 0) return;
        std::fflush(nullptr);
        ::_exit(1);
      }, nullptr);
    });
  }, "Makes the process exit with status 1 where it would exit with 0 (a background save failed unseen).");
  m.def("_saves_inherited_at_fork", &hbmio::saves_inherited_at_fork,
        "In a child of fork(): the paths of the parent's background saves in flight when it forked.");
  m.def("_staging_pool", [] {
    const hbmio::StagingPoolStats s = hbmio::staging_pool_stats();
    return std::make_tuple(s.capacity, s.allocated, s.in_use);
  }, "(capacity, allocated, in use) bytes of the pinned pool of background saves.");

  m.def("_check_shared", [](nb::dict tensors, const std::string& where) { (void)gather_tensors(tensors, where); },
        nb::arg("tensors"), nb::arg("where"),
        "RuntimeError naming the tensors whose bytes overlap (what save_file refuses), TypeError for a key that is not a str.");
  m.def("_serialize", &serialize, nb::arg("tensors"), nb::arg("metadata") = nb::none(),
        "{name: host array} -> bytes of a safetensors file (the reference writer's header layout).");
  m.def("_dtype_error", [](int err, const std::string& message) {
    // hbmio.DtypeError(err, message), for the Python side's own dtype refusals (hbmio/_dtypes.py).
    PyObject* made = PyObject_CallObject(dtype_error_type(), nb::make_tuple(err, message).ptr());
    if (made == nullptr) throw nb::python_error();
    return nb::steal(made);
  }, nb::arg("errno"), nb::arg("message"));
  m.def("_deserialize", &deserialize, nb::arg("data"),
        "The validated header of safetensors bytes: ([(name, dtype, shape, offset, bytes)], metadata or None).");
  m.def("_copy_bytes", &copy_bytes, nb::arg("data"), nb::arg("offsets"), nb::arg("dests"),
        "Copies data[offsets[i]:offsets[i] + nbytes] into each host array dests[i].");
  m.def("parse_size", [](const std::string& text) -> std::uint64_t {
    // One parser for sizes, the command line's: max_shard_size="5GB" means in Python what
    // --max-shard-size 5GB means to the hbmio command.
    try {
      return hbmio::parse_size(text);
    } catch (const hbmio::Error& e) {
      throw nb::value_error(e.what());
    }
  }, nb::arg("text"), "hbmio::parse_size, the parser of the hbmio command's sizes: bytes of \"4096\", \"16MiB\", \"5GB\"; "
     "ValueError naming the accepted forms for anything else.");

  // The library's configuration (hbmio/config.hpp): Python reads no HBMIO_* variable itself.
  m.def("_configured_backend", &hbmio::configured_backend, "HBMIO_BACKEND, else \"auto\"; hbmio.Error for an unknown name.");
  m.def("_configured_readahead", &hbmio::configured_readahead, "HBMIO_READAHEAD in bytes, else 1 GiB; hbmio.Error for an invalid value.");

  m.def("backends", [] {
    std::vector<hbmio::BackendStatus> probe;
    {
      nb::gil_scoped_release release;
      probe = hbmio::probe_backends();
    }
    nb::list out;
    for (const auto& b : probe) {
      nb::dict d;
      d["name"] = b.name;
      d["available"] = b.available;
      d["detail"] = b.detail;
      out.append(d);
    }
    return out;
  }, "What each backend can do on this machine: [{name, available, detail}].");

  m.def("_memory_counters", [] {
    auto c = hbmio::memory_counters();
    nb::dict d;
    d["host_buffers"] = c.host_buffers;
    d["pinned_buffers"] = c.pinned_buffers;
    d["device_buffers"] = c.device_buffers;
    d["host_bytes"] = c.host_bytes;
    d["pinned_bytes"] = c.pinned_bytes;
    d["device_bytes"] = c.device_bytes;
    return d;
  }, "Live hbmio allocations by kind (buffers and bytes).");

  m.def("cuda_device_count", &hbmio::cuda_device_count);
  m.def("cuda_unavailable_reason", &hbmio::cuda_unavailable_reason);

  // Test support: what a DLPack producer hands over (imported through __dlpack__), with a copy of
  // the bytes for host arrays. Lets tests check dtypes NumPy cannot represent (bfloat16, float8).
  m.def("_inspect", [](nb::ndarray<nb::ro> a) {
    nb::list shape;
    for (std::size_t i = 0; i < a.ndim(); ++i) shape.append(a.shape(i));
    nb::object data = nb::none();
    if (a.device_type() == nb::device::cpu::value) {
      bool contiguous = true;
      std::int64_t expected = 1;
      for (std::size_t i = a.ndim(); i-- > 0;) {
        if (a.shape(i) != 1 && a.stride(i) != expected) contiguous = false;
        expected *= static_cast<std::int64_t>(a.shape(i));
      }
      if (!contiguous) throw nb::value_error("_inspect: array is not C-contiguous");
      data = nb::bytes(static_cast<const char*>(a.data()), a.nbytes());
    }
    nb::dict d;
    d["code"] = a.dtype().code;
    d["bits"] = a.dtype().bits;
    d["shape"] = nb::tuple(shape);
    d["device_type"] = a.device_type();
    d["device_id"] = a.device_id();
    d["data_ptr"] = reinterpret_cast<std::uintptr_t>(a.data());
    d["bytes"] = data;
    return d;
  });

  nb::class_<PyStream>(m, "_Stream", "The engine of hbmio.stream: batches of shard records read ahead into a ring.")
      .def("__init__", [](PyStream* self, std::vector<std::string> files, const std::string& device, std::uint64_t batch_records,
                          std::uint64_t batch_bytes, const std::string& format, std::vector<std::string> tensors,
                          std::optional<std::string> dtype, std::vector<std::uint64_t> record_shape, unsigned read_ahead,
                          bool drop_last, std::uint64_t epochs, bool shuffle, std::uint64_t seed, std::uint64_t shuffle_window,
                          unsigned rank, unsigned world, const std::string& backend, std::optional<nb::dict> resume) {
        hbmio::StreamOptions o{.format = shard_format(format), .tensors = std::move(tensors), .raw_record_shape = std::move(record_shape),
                               .device = parse_device(device), .batch_records = batch_records, .batch_bytes = batch_bytes,
                               .read_ahead = read_ahead, .drop_last = drop_last, .epochs = epochs, .shuffle = shuffle, .seed = seed,
                               .shuffle_window = shuffle_window, .rank = rank, .world = world, .backend = backend};
        if (dtype) {
          o.raw_dtype = hbmio::safetensors::parse_dtype(*dtype);
          if (!o.raw_dtype) throw nb::value_error(("unknown record dtype '" + *dtype + "'").c_str());
        }
        if (resume) o.resume = PyStream::position_of(*resume);
        new (self) PyStream(std::move(files), std::move(o));
      }, nb::arg("files"), nb::arg("device"), nb::arg("batch_records"), nb::arg("batch_bytes"), nb::arg("format"),
         nb::arg("tensors"), nb::arg("dtype").none(), nb::arg("record_shape"), nb::arg("read_ahead"), nb::arg("drop_last"),
         nb::arg("epochs"), nb::arg("shuffle"), nb::arg("seed"), nb::arg("shuffle_window"), nb::arg("rank"), nb::arg("world"),
         nb::arg("backend"), nb::arg("resume").none() = nb::none())
      .def("next", &PyStream::next, nb::arg("cuda_stream") = 0,
           "The next batch as (epoch, index, records, last_of_epoch, [arrays]), or None after the last one; the batch "
           "before it goes back to the ring (after the work queued on cuda_stream, a cudaStream_t, when on a GPU).")
      .def("fields", &PyStream::fields, "[(name, dtype, record_shape, record_bytes)] (waits for the shards' headers).")
      .def("sizes", &PyStream::sizes, "(records per epoch on this rank, records per full batch).")
      .def("stats", &PyStream::stats)
      .def("position", &PyStream::position,
           "Where this rank is after the batches next() returned: {epoch, pool, world, batches, fingerprint, fields, "
           "batch_records} (waits for the shards' headers).")
      .def("fingerprint", &PyStream::fingerprint, "The shards' names, sizes and headers, hashed (waits for the headers).")
      .def("epoch_stats", &PyStream::epoch_stats)
      .def("close", &PyStream::close);

  nb::class_<ReadQueue>(m, "_ReadQueue", "The read-ahead's reader: batches of a SafeOpen read in order on the library's pool (hbmio::ReadQueue).")
      .def("push", [](ReadQueue& q, const std::vector<std::size_t>& indices, const nb::list& dests,
                      const std::string& location, nb::object keep, std::optional<std::vector<std::uint64_t>> offsets,
                      std::optional<std::vector<std::uint64_t>> lengths) {
        return q.push(tensor_reads(q.checkpoint(), indices, dests, offsets, lengths, location), std::move(keep));
      }, nb::arg("indices"), nb::arg("dests"), nb::arg("location"), nb::arg("keep"), nb::arg("offsets") = nb::none(),
         nb::arg("lengths") = nb::none(),
         "Queues a read of tensors (or of byte ranges of them) into the addresses `dests` in `location`, in memory "
         "`keep` holds; returns the batch's number.")
      .def("wait", &ReadQueue::wait, nb::arg("batch"), "Waits for a batch; raises its read's error.");

  nb::class_<Handle>(m, "SafeOpen", "A checkpoint opened for lazy, per-tensor loads (like safetensors.safe_open).")
      .def("__init__", [](Handle* self, const std::string& path) {
        std::optional<hbmio::OpenedCheckpoint> opened;
        {
          nb::gil_scoped_release release;
          opened.emplace(path);
        }
        new (self) Handle{std::make_shared<const hbmio::OpenedCheckpoint>(std::move(*opened))};
      }, nb::arg("path"))
      .def_prop_ro("path", [](const Handle& h) { return h.path(); })
      .def("report", [](const Handle& h) {
        hbmio::Stats total;
        std::uint64_t reads = 0;
        {
          std::lock_guard lock(h.report->mutex);
          total = h.report->total;
          reads = h.report->reads;
        }
        nb::dict d = stats_dict(total);
        d["reads"] = reads;
        return d;
      }, "What this handle's reads did so far, summed: bytes, seconds (of the reads, not of the time between), "
         "reads (batches), backend, bytes_direct, note (the latest read's) and paths (per file: the way it took and why).")
      .def("keys", [](const Handle& h) {
        // Sorted by name, as safetensors' safe_open.keys() (offset_keys() gives file order).
        std::vector<std::string> keys;
        for (const auto& t : h.checkpoint->tensors()) keys.push_back(t.info->name);
        std::sort(keys.begin(), keys.end());
        return keys;
      })
      .def("offset_keys", [](const Handle& h) {
        std::vector<std::string> keys;
        for (const auto& t : h.checkpoint->tensors()) keys.push_back(t.info->name);
        return keys;
      })
      .def("metadata", [](const Handle& h) -> nb::object {
        // None where the file has no __metadata__, as safetensors' safe_open; {} for an empty one.
        if (h.checkpoint->metadata().empty() && !h.checkpoint->has_metadata()) return nb::none();
        return nb::cast(h.checkpoint->metadata());
      })
      .def("files", [](const Handle& h) {
        std::vector<std::string> paths;
        for (const auto& f : h.files()) paths.push_back(f.path);
        return paths;
      })
      .def("dtype", [](const Handle& h, const std::string& name) {
        return std::string(hbmio::safetensors::to_string(h.info(name).dtype));
      })
      .def("shape", [](const Handle& h, const std::string& name) { return h.info(name).shape; })
      .def("_entries", [](const Handle& h) {
        // (name, dtype, shape, bytes) of every tensor in file order: what the Python side indexes once.
        nb::list out;
        for (const auto& t : h.checkpoint->tensors()) {
          nb::list shape;
          for (auto n : t.info->shape) shape.append(n);
          out.append(nb::make_tuple(t.info->name, std::string(hbmio::safetensors::to_string(t.info->dtype)), shape, t.info->size()));
        }
        return out;
      })
      .def("_read", [](const Handle& h, const std::vector<std::size_t>& indices, const nb::list& dests,
                       std::optional<std::vector<std::uint64_t>> offsets, std::optional<std::vector<std::uint64_t>> lengths,
                       const std::string& backend, std::optional<std::string> location) {
        std::vector<hbmio::TensorRead> reads = tensor_reads(*h.checkpoint, indices, dests, offsets, lengths, location);
        nb::gil_scoped_release release;
        EngineLease engine(backend);
        h.report->add(h.checkpoint->read(reads, *engine.get()));
      }, nb::arg("indices"), nb::arg("dests"), nb::arg("offsets") = nb::none(), nb::arg("lengths") = nb::none(),
         nb::arg("backend") = "auto", nb::arg("location") = nb::none(),
         "Reads tensors (indices into _entries()), or byte ranges of them, into `dests` in one batch: arrays, or "
         "with `location` (\"cpu\", \"cuda:N\") addresses of memory there that the caller keeps alive.")
      .def("_data_offsets", [](const Handle& h, std::size_t i) {
        // (begin, end) of tensor i within its file's data section, as the header writes them.
        const auto& tensors = h.checkpoint->tensors();
        if (i >= tensors.size()) throw nb::index_error("_data_offsets: no such tensor");
        return nb::make_tuple(tensors[i].info->begin, tensors[i].info->end);
      }, nb::arg("index"))
      .def("_placements", [](const Handle& h) {
        // (file index, byte offset in that file) of every tensor in file order: where a mapping of
        // the file holds it (SafeOpen(mmap=True)).
        nb::list out;
        for (const auto& t : h.checkpoint->tensors()) out.append(nb::make_tuple(t.file, t.file_offset));
        return out;
      })
      .def("_map_fd", [](const Handle& h, std::size_t file) -> nb::object {
        // A new descriptor of file `file` as it was opened (never a file that took its name since),
        // for the caller to map and close; None for a file at a URL, which cannot be mapped.
        const auto& files = h.files();
        if (file >= files.size()) throw nb::index_error("_map_fd: no such file");
        if (files[file].remote) return nb::none();
        const std::shared_ptr<const hbmio::File> opened = hbmio::reopen(files[file]);
        const int fd = ::fcntl(opened->fd(), F_DUPFD_CLOEXEC, 0);
        if (fd < 0) throw hbmio::Error(hbmio::errno_code(errno), {.op = "duplicate the descriptor of", .path = files[file].path});
        return nb::int_(fd);
      }, nb::arg("file"))
      .def("_read_queue", [](const Handle& h, const std::string& backend) { return new ReadQueue(h, backend); },
           nb::arg("backend") = "auto",
           "A reader of batches of this checkpoint's tensors, in order, on a thread and an engine of its own.")
      .def("get_tensor", [](const Handle& h, const std::string& name, const std::string& device,
                            const std::string& backend, nb::handle verify) {
        h.info(name);  // KeyError for an unknown name
        nb::dict one = load(h.path(), device, backend, verify, std::vector<std::string>{name}, nullptr, nb::none());
        return nb::object(one[nb::str(name.c_str(), name.size())]);
      }, nb::arg("name"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
         nb::arg("verify").none() = false)
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](nb::handle, nb::args) { return false; });
}
