// The pieces every topic of the binding uses: dtypes and devices, verify=, report=, raw arrays.
#include "binding.hpp"

namespace hbmio_py {

// DLPack type codes (dlpack.h, v1.1). Raw numbers, so older nanobind releases (without the
// float8 enumerators) build too.
enum : std::uint8_t {
  kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6,
  kFloat8_e4m3fn = 10, kFloat8_e4m3fnuz = 11, kFloat8_e5m2 = 12, kFloat8_e5m2fnuz = 13, kFloat8_e8m0fnu = 14,
  kFloat4_e2m1fn = 17,
};

nb::dlpack::dtype dl(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes = 1) { return {code, bits, lanes}; }


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

hbmio::CacheUse cache_use(const std::string& cache) {
  if (cache.empty()) return hbmio::CacheUse::configured;
  if (cache == "off") return hbmio::CacheUse::off;
  if (cache == "use") return hbmio::CacheUse::use;
  if (cache == "add") return hbmio::CacheUse::add;
  throw nb::value_error(("cache must be None, False, True, \"use\", \"add\" or \"off\", not '" + cache + "'").c_str());
}

hbmio::LoadOptions load_options(const std::string& backend, VerifyMode verify, std::optional<std::vector<std::string>> names,
                                Progress* progress, const std::string& cache) {
  hbmio::LoadOptions options;
  options.cache = cache_use(cache);
  options.backend = backend;
  options.verify = verify.verify;
  options.require_checksums = verify.strict;
  if (names) options.names = std::move(*names);
  if (progress) options.progress = &progress->done;
  return options;
}

// Stats::paths as Python sees them: [{file, path, reason, bytes, bytes_direct}], `path` one of
// "gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix", "remote", "cache-host",
// "cache-device", "cache-shared".
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
  into["wake_seconds"] = s.wake_seconds;
  into["drain_seconds"] = s.drain_seconds;
  into["copy_wait_seconds"] = s.copy_wait_seconds;
  into["note"] = s.note;
  into["paths"] = paths_list(s.paths);
}

// report=: None, or a dict the call fills with what its transfer did (fill_stats).
void report_into(nb::handle report, const hbmio::Stats& s) {
  if (report.is_none()) return;
  if (!nb::isinstance<nb::dict>(report)) throw nb::type_error("report= takes a dict to fill (or None)");
  fill_stats(nb::borrow<nb::dict>(report), s);
}


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

}  // namespace hbmio_py
