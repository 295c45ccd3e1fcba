// hbmio.stream's engine: hbmio::BatchStream with its batches as DLPack views.
#include "binding.hpp"

namespace hbmio_py {

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

  static nb::dict to_dict(const hbmio::StreamStats& s, bool with_paths = true) {
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
    if (with_paths) {  // the whole stream's only (StreamStats::paths and the engine's groups)
      d["paths"] = paths_list(s.paths);
      nb::dict groups;
      groups["count"] = s.groups;
      groups["seconds"] = s.group_seconds;
      groups["wake_seconds"] = s.wake_seconds;
      groups["drain_seconds"] = s.drain_seconds;
      groups["copy_wait_seconds"] = s.copy_wait_seconds;
      d["groups"] = groups;
    }
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
    d["epochs"] = p.epochs;
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
    if (d.contains("epochs")) p.epochs = nb::cast<std::vector<std::uint64_t>>(d["epochs"]);
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
    for (const auto& s : stream_->epoch_stats()) out.append(to_dict(s, false));
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

void bind_stream(nb::module_& m) {
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
}

}  // namespace hbmio_py
