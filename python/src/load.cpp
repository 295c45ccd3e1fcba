// Loads (load_file, _load_into, plans), raw reads and writes, and lazy access (SafeOpen and its
// read-ahead's queue).
#include <set>
#include <unordered_map>

#include "binding.hpp"

namespace hbmio_py {

// For run_interruptible around a load: a Ctrl-C (interrupted_by_signal) also tells the load to
// stop its reads (`cancel`, its LoadOptions::cancel), so a load of hundreds of GiB ends within
// a chunk rather than at its last byte; KeyboardInterrupt is raised once it has returned.
std::function<bool()> interrupted_stopping(std::atomic<bool>& cancel) {
  return [&cancel] {
    if (!interrupted_by_signal()) return false;
    cancel = true;
    return true;
  };
}

// Runs a load (Ctrl-C stops it) and returns the checkpoint in a capsule that owns it: the
// capsule's destructor frees it once the last array made over its memory is gone.
std::pair<nb::capsule, const hbmio::LoadedCheckpoint*> run_load(const std::string& path, const std::string& device,
                                                                const std::string& backend, nb::handle verify,
                                                                std::optional<std::vector<std::string>> names, Progress* progress,
                                                                nb::handle report, const std::string& cache, bool share) {
  hbmio::LoadOptions options = load_options(backend, verify_mode(verify), std::move(names), progress, cache);
  options.into = parse_device(device);
  options.share = share;
  std::atomic<bool> cancel{false};
  options.cancel = &cancel;
  auto* loaded = new hbmio::LoadedCheckpoint();
  hbmio::InterruptibleRun run;
  {
    nb::gil_scoped_release release;
    EngineLease engine(backend);
    options.engine = engine.get();
    // On the library's pool, while this thread checks for Ctrl-C every 50 ms.
    run = hbmio::run_interruptible([&](const std::atomic<bool>&) { *loaded = hbmio::load_checkpoint(path, options); },
                                   interrupted_stopping(cancel));
  }
  if (run.interrupted || run.error) {
    delete loaded;
    if (run.interrupted) throw nb::python_error();  // KeyboardInterrupt (the load's ECANCELED says less)
    std::rethrow_exception(run.error);
  }
  // From here the capsule owns the checkpoint.
  nb::capsule owner(loaded, [](void* p) noexcept { delete static_cast<hbmio::LoadedCheckpoint*>(p); });
  warn_unverified(*loaded);
  report_into(report, loaded->stats());
  return {owner, loaded};
}

Array tensor_array(const hbmio::LoadedTensor& t, nb::handle owner) {
  std::vector<std::size_t> shape = dlpack_shape(t.dtype, t.shape, t.name);
  return Array(t.data.data, shape.size(), shape.data(), owner, nullptr, to_dlpack(t.dtype, t.name), dlpack_device_type(t.data.location),
               t.data.location.kind == hbmio::MemoryKind::device ? t.data.location.device : 0);
}

// Loads and wraps every tensor as a DLPack array owned by one capsule.
nb::dict load(const std::string& path, const std::string& device, const std::string& backend, nb::handle verify,
              std::optional<std::vector<std::string>> names, Progress* progress, nb::handle report, const std::string& cache,
              bool share) {
  const auto [owner, loaded] = run_load(path, device, backend, verify, std::move(names), progress, report, cache, share);
  nb::dict result;
  for (const auto& t : loaded->tensors())
    result[nb::str(t.name.c_str(), t.name.size())] = nb::cast(tensor_array(t, owner), nb::rv_policy::reference);
  return result;
}

nb::tuple new_tuple(std::size_t n) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(n));
  if (tuple == nullptr) throw nb::python_error();
  return nb::steal<nb::tuple>(tuple);
}

// (name, dtype, shape, strides, a, b): shape and contiguous strides (in elements) as tuples, as
// torch's contiguous strides (a dimension of 0 counts as 1: an empty tensor's strides then match
// what torch.empty(shape) would have).
nb::tuple view_row(const std::string& name, hbmio::safetensors::Dtype dtype, const std::vector<std::uint64_t>& dims, nb::object a,
                   nb::object b) {
  std::vector<std::uint64_t> strides(dims.size(), 1);
  for (std::size_t i = dims.size(); i > 1; --i) strides[i - 2] = strides[i - 1] * std::max<std::uint64_t>(dims[i - 1], 1);
  nb::tuple shape = new_tuple(dims.size()), stride = new_tuple(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    PyTuple_SET_ITEM(shape.ptr(), static_cast<Py_ssize_t>(i), nb::int_(dims[i]).release().ptr());
    PyTuple_SET_ITEM(stride.ptr(), static_cast<Py_ssize_t>(i), nb::int_(strides[i]).release().ptr());
  }
  return nb::make_tuple(name, std::string(hbmio::safetensors::to_string(dtype)), shape, stride, a, b);
}

// A tensor that is a typed view of one of a load's allocations: `offset` counts its dtype's elements.
struct ViewSource {
  const std::string* name;
  hbmio::safetensors::Dtype dtype;
  const std::vector<std::uint64_t>* shape;
  int base;
  std::uint64_t offset;
};

// The views of thousands of tensors in one pass, for the Python that makes them (load_file into a
// GPU, share=True): one as_strided per tensor was most of a device-tier hit of 3,072 tensors
// (bench/RESULTS.md, "Restarts from the node's resident cache"). Tensors of one dtype, shape and
// allocation whose names differ only in their numbers (one weight of every layer) and that lie a
// constant step apart form a group, which Python makes with one call:
// as_strided((n, *shape), (step, *strides), offset).unbind(0).
// Returns (names, groups): every name in the order given (the dict's order), and per group
// (names, dtype, shape, strides, base, offset, step), step 0 for a group of one.
nb::tuple view_groups(const std::vector<ViewSource>& items) {
  nb::list order;
  std::vector<nb::str> names;
  names.reserve(items.size());
  for (const ViewSource& v : items) {
    names.emplace_back(v.name->data(), v.name->size());
    order.append(names.back());
  }
  // Bucketed by (name with each run of digits as '#', dtype, shape, allocation), first seen first.
  std::unordered_map<std::string, std::size_t> bucket_of;
  std::vector<std::vector<std::uint32_t>> buckets;
  std::string key;
  for (std::uint32_t i = 0; i < items.size(); ++i) {
    const ViewSource& v = items[i];
    key.clear();
    for (std::size_t c = 0; c < v.name->size(); ++c) {
      const char ch = (*v.name)[c];
      if (ch < '0' || ch > '9') key += ch;
      else if (c == 0 || (*v.name)[c - 1] < '0' || (*v.name)[c - 1] > '9') key += '#';
    }
    key += '\x1f';
    key += std::to_string(static_cast<int>(v.dtype));
    for (std::uint64_t d : *v.shape) (key += ',') += std::to_string(d);
    (key += '\x1f') += std::to_string(v.base);
    const auto [it, added] = bucket_of.try_emplace(key, buckets.size());
    if (added) buckets.emplace_back();
    buckets[it->second].push_back(i);
  }
  nb::list groups;
  for (std::vector<std::uint32_t>& bucket : buckets) {
    std::sort(bucket.begin(), bucket.end(), [&](std::uint32_t a, std::uint32_t b) { return items[a].offset < items[b].offset; });
    const ViewSource& first = items[bucket.front()];
    std::uint64_t elements = 1;
    for (std::uint64_t d : *first.shape) elements *= d;
    const nb::tuple row = view_row(*first.name, first.dtype, *first.shape, nb::none(), nb::none());
    // Runs at one step, each tensor's elements apart from the next's (an empty tensor is a group
    // of one: several may share an offset).
    for (std::size_t start = 0; start < bucket.size();) {
      std::size_t end = start + 1;
      std::uint64_t step = 0;
      if (elements > 0 && end < bucket.size()) {
        step = items[bucket[end]].offset - items[bucket[start]].offset;
        if (step >= elements)
          while (end < bucket.size() && items[bucket[end]].offset - items[bucket[end - 1]].offset == step) ++end;
      }
      if (end == start + 1) step = 0;
      nb::list members;
      for (std::size_t k = start; k < end; ++k) members.append(names[bucket[k]]);
      groups.append(nb::make_tuple(members, row[1], row[2], row[3], first.base, items[bucket[start]].offset, step));
      start = end;
    }
  }
  return nb::make_tuple(order, groups);
}

// A load's plan (hbmio::plan_load), kept between the two steps of _load_torch_into: the size and
// dtypes before the load starts, the views' groups while it reads.
struct LoadLayout {
  std::vector<hbmio::PlannedTensor> plan;
  nb::list rows() const {
    nb::list out;
    for (const hbmio::PlannedTensor& t : plan) out.append(view_row(t.name, t.dtype, t.shape, nb::int_(t.memory_offset), nb::int_(t.size)));
    return out;
  }
  // view_groups of the one allocation (offsets are multiples of 256: whole elements of any dtype
  // of a byte or more; the caller loads sub-byte dtypes another way).
  nb::tuple groups() const {
    std::vector<ViewSource> items;
    items.reserve(plan.size());
    for (const hbmio::PlannedTensor& t : plan) {
      const unsigned bits = hbmio::safetensors::bits_per_element(t.dtype);
      items.push_back({&t.name, t.dtype, &t.shape, 0, bits >= 8 ? t.memory_offset / (bits / 8) : t.memory_offset});
    }
    return view_groups(items);
  }
};

// load() for a caller that makes the tensors views itself (hbmio.load_file(share=True) in torch):
// thousands of DLPack arrays, each imported on its own, took longer than the load they came from
// (bench/RESULTS.md, "Restarts from the node's resident cache"). Returns (bases, names, groups,
// arrays): a 1-D byte array per allocation the tensors lie in; every name in file order; the
// view_groups of the tensors that are views of bases[base] (offsets in elements); and (name,
// array) for each tensor that is not (sub-byte dtypes, an offset that is not a whole number of
// elements, memory the load does not own).
nb::tuple load_views(const std::string& path, const std::string& device, const std::string& backend, nb::handle verify,
                     std::optional<std::vector<std::string>> names, Progress* progress, nb::handle report, const std::string& cache,
                     bool share) {
  const auto [owner, loaded] = run_load(path, device, backend, verify, std::move(names), progress, report, cache, share);
  std::vector<hbmio::MemorySpan> memory = loaded->memory();
  std::sort(memory.begin(), memory.end(), [](const auto& a, const auto& b) { return a.data < b.data; });
  std::vector<int> base_of(memory.size(), -1);  // index in `bases`, made on first use
  nb::list bases, arrays;
  std::vector<ViewSource> views;
  for (const hbmio::LoadedTensor& t : loaded->tensors()) {
    const unsigned bits = hbmio::safetensors::bits_per_element(t.dtype);
    // The allocation holding the tensor: the last that starts at or before it, if it ends after it.
    auto at = std::upper_bound(memory.begin(), memory.end(), t.data.data, [](const std::byte* p, const auto& m) { return p < m.data; });
    std::size_t region = memory.size();
    if (at != memory.begin()) {
      const auto& m = *std::prev(at);
      if (t.data.data + t.data.size <= m.data + m.size && m.location == t.data.location)
        region = static_cast<std::size_t>(std::prev(at) - memory.begin());
    }
    const std::uint64_t offset = region < memory.size() ? static_cast<std::uint64_t>(t.data.data - memory[region].data) : 0;
    if (region == memory.size() || bits % 8 != 0 || offset % (bits / 8) != 0) {
      arrays.append(nb::make_tuple(t.name, nb::cast(tensor_array(t, owner), nb::rv_policy::reference)));
      continue;
    }
    if (base_of[region] < 0) {
      const hbmio::MemorySpan& m = memory[region];
      const std::size_t size = m.size;
      base_of[region] = static_cast<int>(bases.size());
      bases.append(nb::cast(Array(m.data, 1, &size, owner, nullptr, nb::dtype<std::uint8_t>(), dlpack_device_type(m.location),
                                  m.location.kind == hbmio::MemoryKind::device ? m.location.device : 0),
                            nb::rv_policy::reference));
    }
    views.push_back({&t.name, t.dtype, &t.shape, base_of[region], offset / (bits / 8)});
  }
  nb::tuple grouped = view_groups(views);
  // Every name in file order: the views' (in file order) and the arrays' merged by file position.
  nb::list order;
  if (arrays.size() == 0) {
    order = nb::borrow<nb::list>(grouped[0]);
  } else {
    std::size_t v = 0;
    nb::list view_names = nb::borrow<nb::list>(grouped[0]);
    std::size_t a = 0;
    for (const hbmio::LoadedTensor& t : loaded->tensors()) {
      if (v < views.size() && views[v].name == &t.name) order.append(view_names[v++]);
      else order.append(nb::borrow<nb::tuple>(arrays[a++])[0]);
    }
  }
  return nb::make_tuple(bases, order, grouped[1], arrays);
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
                                            const std::optional<std::string>& location, bool one_allocation = false) {
  // one_allocation: the caller's destinations lie in one allocation (a prefetch's batch), so reads
  // adjacent in the file and in memory may be read as one range (TensorRead::allocation).
  static std::atomic<std::uint64_t> allocations{0};
  const std::uint64_t allocation = one_allocation ? ++allocations : 0;
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
    reads[i].allocation = allocation;
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
// A load _load_into(background=True) started on the library's pool (hbmio::load_started): Python
// builds its tensors' views meanwhile, then calls wait(). Holds what the load reads and writes.
struct LoadJob {
  // Alive while the load runs: its files, its memory (the object given and the array exported
  // from it, which holds the memory even if the object's storage is replaced meanwhile), where
  // its report goes and the counter it advances.
  nb::object checkpoint, dest, report, progress;
  nb::ndarray<nb::ro> memory;
  std::atomic<bool> cancel{false};  // LoadOptions::cancel: set by a Ctrl-C in wait(), or cancel()
  std::optional<EngineLease> engine;
  std::optional<hbmio::LoadInProgress> running;

  LoadJob() = default;
  LoadJob(const LoadJob&) = delete;
  LoadJob& operator=(const LoadJob&) = delete;
  // Dropped without wait(): the load still writes `dest`, so wait for it (without the GIL: the
  // pool thread may need it for a progress bar).
  ~LoadJob() {
    nb::gil_scoped_release release;
    running.reset();
    engine.reset();
  }

  void wait() {
    if (!running) throw nb::value_error("_LoadJob.wait(): waited for already");
    std::optional<hbmio::LoadInProgress> job = std::move(running);
    running.reset();
    hbmio::LoadResult result;
    hbmio::InterruptibleRun run;
    {
      nb::gil_scoped_release release;
      run = hbmio::run_interruptible([&](const std::atomic<bool>&) { result = job->wait(); }, interrupted_stopping(cancel));
      job.reset();
      engine.reset();
    }
    if (run.interrupted) throw nb::python_error();  // KeyboardInterrupt, once the load has stopped
    if (run.error) std::rethrow_exception(run.error);
    const hbmio::LoadedCheckpoint& loaded = result.locations.front();
    warn_unverified(loaded);
    report_into(report, loaded.stats());
  }
};

nb::object load_into(nb::handle checkpoint, nb::handle dest, const std::string& backend, nb::handle verify,
                     std::optional<std::vector<std::string>> names, Progress* progress, bool entries, nb::handle report,
                     const std::string& cache, bool background) {
  const Target target = target_of(checkpoint);
  RawArray to = raw_array(dest, true, "_load_into");
  hbmio::LoadOptions options = load_options(backend, verify_mode(verify), std::move(names), progress, cache);
  // The load's location is the destination's: they cannot disagree. A host destination gets the
  // host kind (a cuda_host array may be pinned, but the engine only needs to know it is host).
  options.into = to.span.location;
  options.destination = to.span;
  // A null destination means "allocate your own" to load_checkpoint, and an empty array may have
  // a null pointer: callers allocate at least one byte (max(plan bytes, 1)).
  if (to.span.data == nullptr || to.span.size == 0) throw nb::value_error("_load_into: the destination must hold at least 1 byte");
  if (background) {
    if (entries) throw nb::value_error("_load_into: background=True returns a job, not entries (pass entries=False)");
    auto job = std::make_unique<LoadJob>();
    job->checkpoint = nb::borrow(checkpoint);
    job->dest = nb::borrow(dest);
    job->memory = to.array;
    job->report = nb::borrow(report);
    if (progress != nullptr) job->progress = nb::find(progress);
    {
      nb::gil_scoped_release release;
      job->engine.emplace(backend);
      options.engine = job->engine->get();
      options.cancel = &job->cancel;
      job->running.emplace(hbmio::load_started({.path = target.path, .files = target.files, .options = std::move(options)}));
    }
    return nb::cast(job.release(), nb::rv_policy::take_ownership);
  }
  hbmio::LoadedCheckpoint loaded;
  {
    nb::gil_scoped_release release;
    EngineLease engine(backend);
    options.engine = engine.get();
    loaded = std::move(hbmio::load({.path = target.path, .files = target.files, .options = options}).locations.front());
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

void bind_load(nb::module_& m) {
  m.def("load_file", &load, nb::arg("path"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify").none() = false, nb::arg("names") = nb::none(), nb::arg("progress").none() = nb::none(),
        nb::arg("report").none() = nb::none(), nb::arg("cache") = "", nb::arg("share") = false,
        "Loads a .safetensors file, a sharded *.index.json or a directory holding either into `device` "
        "(\"cpu\", \"pinned\", \"cuda\", \"cuda:N\"). Returns {name: DLPack array} in file order. `report`, a "
        "dict, is filled with bytes, seconds, backend, note and paths (per file: the way it took and why). `cache`: "
        "\"\" (HBMIO_CACHE decides), \"off\", \"use\" or \"add\" (the node's resident cache, docs/cache.md). "
        "`share`: into a GPU, the files the cache holds in its memory are its copy mapped in place (LoadOptions::share).");

  m.def("_load_views", &load_views, nb::arg("path"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify").none() = false, nb::arg("names") = nb::none(), nb::arg("progress").none() = nb::none(),
        nb::arg("report").none() = nb::none(), nb::arg("cache") = "", nb::arg("share") = false,
        "load_file as (bases, names, groups, arrays): a 1-D uint8 DLPack array per allocation the tensors lie in, "
        "every name in file order, the views of the bases as groups (names, dtype, shape, strides, base index, "
        "element offset, element step), and (name, DLPack array) per tensor that is no whole-element view of a base.");

  m.def("_load_into", &load_into, nb::arg("checkpoint"), nb::arg("dest"), nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify").none() = false, nb::arg("names") = nb::none(), nb::arg("progress").none() = nb::none(),
        nb::arg("entries") = true, nb::arg("report").none() = nb::none(), nb::arg("cache") = "", nb::arg("background") = false,
        "Loads `checkpoint` (a path, or a SafeOpen: its headers are not read again) into `dest` (a writable "
        "C-contiguous array, host or CUDA, that holds _plan()'s layout: last offset + bytes); "
        "returns [(name, dtype, shape, byte offset in dest)] in file order. background=True (with "
        "entries=False): starts the load on the library's pool and returns a _LoadJob, whose wait() "
        "returns once it is done (and fills `report`).");

  nb::class_<LoadJob>(m, "_LoadJob", "A load started by _load_into(background=True); dropping it waits for the load.")
      .def("wait", &LoadJob::wait, "Waits for the load; raises what it raised, fills its report. A signal meanwhile "
           "(Ctrl-C) stops the load's reads, waits for those in flight and raises the signal's exception.")
      .def("cancel", [](LoadJob& job) { job.cancel = true; },
           "Tells the load to stop: reads not started are skipped, and wait() raises hbmio.Error (ECANCELED).");

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

  // The tensors a load takes, in the order it lays them out, and where each lands in the single
  // allocation. Distributed loads split this list among ranks (hbmio/distributed.py) and must agree
  // on the layout: it comes from here, not a copy. ENOENT for a name the checkpoint does not hold.
  const auto planned = [](nb::handle checkpoint, std::optional<std::vector<std::string>> names) {
    const Target target = target_of(checkpoint);
    hbmio::LoadOptions options;
    if (names) options.names = std::move(*names);
    nb::gil_scoped_release release;
    return hbmio::plan_load({.path = target.path, .files = target.files, .options = options}).tensors;
  };
  m.def("_plan", planned, nb::arg("checkpoint"), nb::arg("names") = nb::none(),
     "A PlannedTensor (name, dtype, shape, size, offset) per tensor a load of `checkpoint` (a path or a SafeOpen) takes, in its layout.");

  // The plan as one tuple per tensor, for the loop that makes thousands of views (load_file into a
  // GPU): (name, dtype, shape, strides, offset, size), shape and contiguous strides (in elements)
  // as tuples. Built here in one pass, that loop costs about half of what reading each
  // _PlannedTensor's attributes and working out its strides in Python did (bench/RESULTS.md,
  // "Restarts from the node's resident cache").
  // What a load into one allocation needs before it starts: the allocation's size and the dtypes
  // (a torch load checks each has a torch equivalent). The rows for its views are made while it
  // reads (hbmio/__init__.py, _load_torch_into).
  m.def("_plan_summary", [planned](nb::handle checkpoint, std::optional<std::vector<std::string>> names) {
    LoadLayout layout{planned(checkpoint, std::move(names))};
    std::set<std::string> dtypes;
    std::uint64_t tensor_bytes = 0;
    for (const hbmio::PlannedTensor& t : layout.plan) {
      dtypes.emplace(hbmio::safetensors::to_string(t.dtype));
      tensor_bytes += t.size;
    }
    const std::uint64_t bytes = layout.plan.empty() ? 0 : layout.plan.back().memory_offset + layout.plan.back().size;
    const std::size_t count = layout.plan.size();
    return nb::make_tuple(bytes, std::vector<std::string>(dtypes.begin(), dtypes.end()), count, tensor_bytes, std::move(layout));
  }, nb::arg("checkpoint"), nb::arg("names") = nb::none(),
     "(bytes, dtypes, tensors, tensor bytes, layout) of a load of `checkpoint` into one allocation: _plan's last "
     "offset + size, its dtypes, how many tensors, their bytes, and the plan itself (layout.rows(): _plan_rows's).");

  nb::class_<LoadLayout>(m, "_LoadLayout", "A load's plan, kept for its rows (_plan_summary).")
      .def("rows", &LoadLayout::rows, "(name, dtype, shape, strides, offset, size) per tensor, in layout order.")
      .def("groups", &LoadLayout::groups,
           "(names, groups): every name in layout order, and the views to make of the one allocation as groups "
           "(names, dtype, shape, strides, 0, offset, step), offsets and steps in elements (view_groups in load.cpp).");

  m.def("_plan_rows", [planned](nb::handle checkpoint, std::optional<std::vector<std::string>> names) {
    return LoadLayout{planned(checkpoint, std::move(names))}.rows();
  }, nb::arg("checkpoint"), nb::arg("names") = nb::none(),
     "_plan's tensors of a load of `checkpoint` as (name, dtype, shape, strides, offset, size) tuples.");

  // A load's plan over several ranks (hbmio::LoadPlan), by name.
  nb::class_<hbmio::LoadPlan>(m, "_LoadPlan")
      .def_ro("tensors", &hbmio::LoadPlan::tensors, "a _PlannedTensor per tensor, in layout order")
      .def_ro("bytes", &hbmio::LoadPlan::bytes, "the single allocation's size")
      .def_ro("reader", &hbmio::LoadPlan::reader, "the rank that reads each tensor")
      .def_ro("ranges", &hbmio::LoadPlan::range, "(begin, end) of the layout per rank; none where begin >= end")
      .def_prop_ro("digest", [](const hbmio::LoadPlan& p) {
        char digest[17];
        std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(p.digest));
        return std::string(digest);
      }, "what the ranks compare before any data moves (hex)");

  m.def("_plan_distributed", [](nb::handle checkpoint, std::optional<std::vector<std::string>> names, int world,
                                 const std::string& placement, std::map<std::string, int> shard_map, nb::handle verify) {
    // hbmio::plan_load over `world` ranks: the plan the C++ NCCL load uses, so torch.distributed
    // loads split, check shard maps and agree exactly as it does.
    const Target target = target_of(checkpoint);
    if (placement != "shard" && placement != "replicate")
      throw hbmio::Error(hbmio::errno_code(EINVAL), {.op = "plan a distributed load", .path = target.path},
                         "placement must be 'replicate' or 'shard', not '" + placement + "'");
    hbmio::LoadRequest request{.path = target.path, .files = target.files,
                               .placement = placement == "shard" ? hbmio::Placement::shard : hbmio::Placement::replicate,
                               .shard_map = std::move(shard_map)};
    if (names) request.options.names = std::move(*names);
    const VerifyMode mode = verify_mode(verify);
    request.options.verify = mode.verify;
    request.options.require_checksums = mode.strict;
    nb::gil_scoped_release release;
    return hbmio::plan_load(request, world);
  }, nb::arg("checkpoint"), nb::arg("names").none(), nb::arg("world"), nb::arg("placement"), nb::arg("shard_map"), nb::arg("verify").none(),
     "hbmio::plan_load over `world` ranks: a _LoadPlan (tensors, bytes, reader, ranges, digest).");

  m.def("_read_into", &read_into, nb::arg("path"), nb::arg("array"), nb::arg("offset") = 0, nb::kw_only(),
        nb::arg("backend") = "auto", nb::arg("progress").none() = nb::none());
  m.def("_write_from", &write_from, nb::arg("path"), nb::arg("array"), nb::arg("offset") = 0, nb::kw_only(),
        nb::arg("backend") = "auto", nb::arg("sync") = true, nb::arg("progress").none() = nb::none());

  nb::class_<ReadQueue>(m, "_ReadQueue", "The read-ahead's reader: batches of a SafeOpen read in order on the library's pool (hbmio::ReadQueue).")
      .def("push", [](ReadQueue& q, const std::vector<std::size_t>& indices, const nb::list& dests,
                      const std::string& location, nb::object keep, std::optional<std::vector<std::uint64_t>> offsets,
                      std::optional<std::vector<std::uint64_t>> lengths, bool one_allocation) {
        return q.push(tensor_reads(q.checkpoint(), indices, dests, offsets, lengths, location, one_allocation), std::move(keep));
      }, nb::arg("indices"), nb::arg("dests"), nb::arg("location"), nb::arg("keep"), nb::arg("offsets") = nb::none(),
         nb::arg("lengths") = nb::none(), nb::arg("one_allocation") = false,
         "Queues a read of tensors (or of byte ranges of them) into the addresses `dests` in `location`, in memory "
         "`keep` holds; returns the batch's number. one_allocation=True: the destinations lie in one allocation, so "
         "reads adjacent in the file and in memory may be one request (never across separate allocations).")
      .def("wait", &ReadQueue::wait, nb::arg("batch"), "Waits for a batch; raises its read's error.");

  nb::class_<Handle>(m, "SafeOpen", "A checkpoint opened for lazy, per-tensor loads (like safetensors.safe_open).")
      .def("__init__", [](Handle* self, const std::string& path, const std::string& cache) {
        const hbmio::CacheUse use = cache_use(cache);
        std::optional<hbmio::OpenedCheckpoint> opened;
        {
          nb::gil_scoped_release release;
          opened.emplace(path, std::nullopt, use);
        }
        new (self) Handle{std::make_shared<const hbmio::OpenedCheckpoint>(std::move(*opened))};
      }, nb::arg("path"), nb::arg("cache") = "")
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
        const std::shared_ptr<const hbmio::File> opened = files[file].open();
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
        nb::dict one = load(h.path(), device, backend, verify, std::vector<std::string>{name}, nullptr, nb::none(), "", false);
        return nb::object(one[nb::str(name.c_str(), name.size())]);
      }, nb::arg("name"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
         nb::arg("verify").none() = false)
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](nb::handle, nb::args) { return false; });
}

}  // namespace hbmio_py
