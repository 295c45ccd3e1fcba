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
//
// The bindings are split by topic (binding.hpp says which file holds what); this file makes the
// module and binds what belongs to no topic: engines, sizes, configuration, backends, CUDA.
#include "binding.hpp"

using namespace hbmio_py;

NB_MODULE(_hbmio, m) {
  m.doc() = "hbmio: tensor data between storage and host/GPU memory (safetensors, DLPack)";
  m.attr("__version__") = hbmio::version();

  bind_errors(m);

  nb::class_<Progress>(m, "_Progress", "Bytes done so far by the call it is passed to (progress=...).")
      .def(nb::init<>())
      .def_prop_ro("done", [](const Progress& p) { return p.done.load(std::memory_order_relaxed); })
      .def("_show", [](Progress& p, std::uint64_t total) {
        // The library's pool draws the bar (no thread of Python's own), into sys.stderr: a
        // notebook's stderr is not the process's. A bar shown already is stopped first.
        p.hide();
        p.line = std::make_unique<hbmio::ProgressLine>("", total, p.done, hbmio::ProgressLine::Ending::keep, [](const std::string& text) {
          nb::gil_scoped_acquire acquire;
          try {
            nb::object err = nb::module_::import_("sys").attr("stderr");
            if (err.is_none()) return;
            err.attr("write")(text);
            err.attr("flush")();
          } catch (...) {  // a closed or odd stderr: no bar, never a failed transfer
          }
        });
      }, nb::arg("total"), "Draws '\\r1.20 GiB / 4.00 GiB  (30%)  3.10 GiB/s' on sys.stderr every 200 ms until _hide().")
      .def("_hide", [](Progress& p) { p.hide(); }, "Stops the bar, drawing its last line and a newline.");

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
  m.def("shown_path", [](const std::string& path) { return hbmio::shown_path(path); }, nb::arg("path"),
        "What a message may show of a path: a URL without its user info, query (a presigned URL's signature) and fragment.");
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
      // Strides of dimensions of extent 1 do not matter, nor any stride of an empty array (torch
      // gives a [2, 0, 3] tensor strides (3, 3, 1), as the reference's loads do).
      for (std::size_t i = a.ndim(); i-- > 0 && a.size() > 0;) {
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


  bind_load(m);
  bind_save(m);
  bind_stream(m);
}
