// Saves (save_file, background saves) and safetensors bytes (serialize, deserialize).
#include "binding.hpp"

namespace hbmio_py {

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

// Python's handler only sets a flag, which PyErr_CheckSignals turns into the exception.
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

void bind_save(nb::module_& m) {
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
}

}  // namespace hbmio_py
