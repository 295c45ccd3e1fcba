// hbmio._hbmio: the Python extension (nanobind) over the public C++ API.
//
// Results are framework-neutral DLPack arrays (nb::ndarray without a framework): NumPy, PyTorch,
// CuPy and JAX take them with from_dlpack without a copy. Lifetime: one load makes one
// LoadedCheckpoint, owned by one capsule; every array of that load holds a reference to the
// capsule, so the memory is freed exactly when the last array using it is gone (no close()).
// The GIL is released around every call that does I/O.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cctype>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "hbmio/checkpoint.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/safetensors.hpp"
#include "hbmio/version.hpp"

namespace nb = nanobind;
using hbmio::safetensors::Dtype;

namespace {

PyObject* g_error_type = nullptr;  // hbmio.Error (a subclass of OSError); lives as long as the module

// DLPack type codes (dlpack.h, v1.1). Raw numbers, so older nanobind releases (without the
// float8 enumerators) build too.
enum : std::uint8_t {
  kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6,
  kFloat8_e4m3fn = 10, kFloat8_e4m3fnuz = 11, kFloat8_e5m2 = 12, kFloat8_e5m2fnuz = 13, kFloat8_e8m0fnu = 14,
};

nb::dlpack::dtype dl(std::uint8_t code, std::uint8_t bits) { return {code, bits, 1}; }

// safetensors dtype -> DLPack dtype. F8_E4M3 is torch.float8_e4m3fn (what safetensors writes for
// it), hence DLPack's e4m3fn. F4/F6 (packed sub-byte) have no element-per-index DLPack form yet.
nb::dlpack::dtype to_dlpack(Dtype d, const std::string& name) {
  switch (d) {
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
  throw hbmio::Error(hbmio::errno_code(ENOTSUP), {.op = "convert to DLPack"},
                     "tensor " + name + " has dtype " + std::string(hbmio::safetensors::to_string(d)) +
                         ", which hbmio's Python binding does not support yet");
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

// Loads and wraps every tensor as a DLPack array owned by one capsule.
nb::dict load(const std::string& path, const std::string& device, const std::string& backend, bool verify,
              std::optional<std::vector<std::string>> names) {
  hbmio::LoadOptions options;
  options.into = parse_device(device);
  options.backend = backend;
  options.verify = verify;
  if (names) options.names = std::move(*names);
  auto* loaded = new hbmio::LoadedCheckpoint();
  try {
    nb::gil_scoped_release release;
    *loaded = hbmio::load_checkpoint(path, options);
  } catch (...) {
    delete loaded;
    throw;
  }
  // From here the capsule owns the checkpoint (its destructor runs when the last array goes).
  nb::capsule owner(loaded, [](void* p) noexcept { delete static_cast<hbmio::LoadedCheckpoint*>(p); });
  nb::dict result;
  for (const auto& t : loaded->tensors()) {
    std::vector<std::size_t> shape(t.shape.begin(), t.shape.end());
    Array array(t.data.data, shape.size(), shape.data(), owner, nullptr, to_dlpack(t.dtype, t.name),
                dlpack_device_type(t.data.location), t.data.location.kind == hbmio::MemoryKind::device ? t.data.location.device : 0);
    result[nb::str(t.name.c_str(), t.name.size())] = nb::cast(array, nb::rv_policy::reference);
  }
  return result;
}

void save(nb::dict tensors, const std::string& path, std::optional<std::map<std::string, std::string>> metadata,
          bool checksums, const std::string& backend, std::uint64_t max_shard_size) {
  using In = nb::ndarray<nb::ro, nb::c_contig>;
  std::vector<In> keep;  // holds every input alive (and contiguous) while the GIL is released
  std::vector<hbmio::TensorToSave> list;
  keep.reserve(tensors.size());
  for (auto [key, value] : tensors) {
    std::string name = nb::cast<std::string>(key);
    In array;
    if (!nb::try_cast(value, array, true)) {
      throw nb::type_error(("tensor " + name + ": expected an array supporting DLPack or the buffer protocol, got " +
                            nb::type_name(value.type()).c_str()).c_str());
    }
    auto dtype = from_dlpack(array.dtype());
    if (!dtype) {
      throw nb::type_error(("tensor " + name + ": DLPack dtype (code " + std::to_string(array.dtype().code) + ", " +
                            std::to_string(array.dtype().bits) + " bits) has no safetensors equivalent").c_str());
    }
    hbmio::MemoryLocation where;
    if (array.device_type() == nb::device::cuda::value) {
      where = {hbmio::MemoryKind::device, array.device_id()};
    } else if (array.device_type() != nb::device::cpu::value && array.device_type() != nb::device::cuda_host::value) {
      throw nb::type_error(("tensor " + name + ": arrays on DLPack device type " +
                            std::to_string(array.device_type()) + " are not supported").c_str());
    }
    hbmio::TensorToSave t;
    t.name = std::move(name);
    t.dtype = *dtype;
    for (std::size_t i = 0; i < array.ndim(); ++i) t.shape.push_back(array.shape(i));
    t.data = {static_cast<std::byte*>(const_cast<void*>(array.data())), array.nbytes(), where};
    list.push_back(std::move(t));
    keep.push_back(std::move(array));
  }
  hbmio::SaveOptions options;
  if (metadata) options.metadata = std::move(*metadata);
  options.checksums = checksums;
  options.backend = backend;
  options.max_shard_size = max_shard_size;
  nb::gil_scoped_release release;
  hbmio::save_checkpoint(path, list, options);
}

// safe_open-like handle: headers read once; tensors loaded one at a time on demand.
struct Handle {
  std::string path;
  std::vector<hbmio::CheckpointFile> files;

  const hbmio::safetensors::TensorInfo& info(const std::string& name) const {
    for (const auto& f : files)
      if (const auto* t = f.header.find(name)) return *t;
    throw nb::key_error(("no tensor " + name + " in " + path).c_str());
  }
};

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const hbmio::Error& e) {
    const auto& category = e.code().category();
    bool has_errno = category == std::generic_category() || category == std::system_category();
    nb::object args = has_errno ? nb::make_tuple(e.code().value(), e.what()) : nb::make_tuple(e.what());
    PyObject* instance = PyObject_CallObject(g_error_type, args.ptr());
    if (!instance) return;  // the constructor's own exception stays set
    nb::object inst = nb::steal(instance);
    nb::setattr(inst, "op", nb::str(e.context().op.c_str()));
    nb::setattr(inst, "path", nb::str(e.context().path.c_str()));
    nb::setattr(inst, "backend", nb::str(e.context().backend.c_str()));
    nb::setattr(inst, "detail", nb::str(e.detail().c_str()));
    PyErr_SetObject(g_error_type, instance);
  }
}

}  // namespace

NB_MODULE(_hbmio, m) {
  m.doc() = "hbmio: tensor data between storage and host/GPU memory (safetensors, DLPack)";
  m.attr("__version__") = hbmio::version();

  g_error_type = PyErr_NewExceptionWithDoc(
      "hbmio.Error",
      "An hbmio failure: the C++ message (operation, file, offset, backend, system message). A subclass of "
      "OSError; errno is set when the failure has an errno value (None for CUDA and cuFile codes).",
      PyExc_OSError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator(translate);

  m.def("load_file", &load, nb::arg("path"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
        nb::arg("verify") = false, nb::arg("names") = nb::none(),
        "Loads a .safetensors file, a sharded *.index.json or a directory holding either into `device` "
        "(\"cpu\", \"pinned\", \"cuda\", \"cuda:N\"). Returns {name: DLPack array} in file order.");

  m.def("save_file", &save, nb::arg("tensors"), nb::arg("path"), nb::arg("metadata") = nb::none(), nb::kw_only(),
        nb::arg("checksums") = true, nb::arg("backend") = "auto", nb::arg("max_shard_size") = 0,
        "Writes {name: array} (anything supporting DLPack or the buffer protocol, host or CUDA) as a "
        "safetensors file, crash-safe (temporary file, fsync, rename, directory fsync).");

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

  nb::class_<Handle>(m, "SafeOpen", "A checkpoint opened for lazy, per-tensor loads (like safetensors.safe_open).")
      .def("__init__", [](Handle* self, const std::string& path) {
        std::vector<hbmio::CheckpointFile> files;
        {
          nb::gil_scoped_release release;
          files = hbmio::open_checkpoint(path);
        }
        new (self) Handle{path, std::move(files)};
      }, nb::arg("path"))
      .def("keys", [](const Handle& h) {
        std::vector<std::string> keys;
        for (const auto& f : h.files)
          for (const auto& t : f.header.tensors) keys.push_back(t.name);
        return keys;
      })
      .def("metadata", [](const Handle& h) {
        return h.files.empty() ? std::map<std::string, std::string>{} : h.files.front().header.metadata;
      })
      .def("files", [](const Handle& h) {
        std::vector<std::string> paths;
        for (const auto& f : h.files) paths.push_back(f.path);
        return paths;
      })
      .def("dtype", [](const Handle& h, const std::string& name) {
        return std::string(hbmio::safetensors::to_string(h.info(name).dtype));
      })
      .def("shape", [](const Handle& h, const std::string& name) { return h.info(name).shape; })
      .def("get_tensor", [](const Handle& h, const std::string& name, const std::string& device,
                            const std::string& backend, bool verify) {
        h.info(name);  // KeyError for an unknown name
        nb::dict one = load(h.path, device, backend, verify, std::vector<std::string>{name});
        return nb::object(one[nb::str(name.c_str(), name.size())]);
      }, nb::arg("name"), nb::arg("device") = "cpu", nb::kw_only(), nb::arg("backend") = "auto",
         nb::arg("verify") = false)
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](nb::handle, nb::args) { return false; });
}
