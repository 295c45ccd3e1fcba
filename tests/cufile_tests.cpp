// Tests of the cufile backend and its libcufile shim.
//
// Suites:
//   CufileShim, CufileProbe  run anywhere: no GPU, no libcufile needed (they skip the parts that
//                            need a loadable libcufile, saying why).
//   CufileEnv                runs only with HBMIO_CUFILE_LIBRARY set to a path that does not exist
//                            (ctest sets it): the process-wide probe must name that path.
//   CufileGpu                needs a CUDA device; skips otherwise. Where the driver or the file
//                            handle cannot be set up, it checks that the error names the cuFile
//                            code and skips the data checks with that message.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "testing/fault_injection.hpp"
#include "io/cufile_verdict.hpp"
#include "io/engine_internal.hpp"
#include "shim/cufile_api.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using hbmio::shim::CufileApi;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A scoped environment variable change, restored on destruction.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A file in HBMIO_TEST_DIR (default: the system temp directory), removed on destruction.
class TempFile {
 public:
  explicit TempFile(const std::vector<std::byte>& contents) {
    static std::atomic<int> counter{0};
    const char* dir = std::getenv("HBMIO_TEST_DIR");
    path_ = (dir && *dir ? fs::path(dir) : fs::temp_directory_path()) /
            ("hbmio_cufile_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".bin");
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(contents.data()), static_cast<std::streamsize>(contents.size()));
    if (!out) throw std::runtime_error("cannot write " + path_.string());
  }
  ~TempFile() {
    std::error_code ignored;
    fs::remove(path_, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  std::string path() const { return path_.string(); }
  std::vector<std::byte> read_back() const {
    std::ifstream in(path_, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::byte> result(bytes.size());
    std::memcpy(result.data(), bytes.data(), bytes.size());
    return result;
  }

 private:
  fs::path path_;
};

std::vector<std::byte> pattern(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> bytes(size);
  std::mt19937_64 random(seed);
  for (auto& b : bytes) b = static_cast<std::byte>(random() & 0xff);
  return bytes;
}

// ---- the error table and category -------------------------------------------------------------

TEST(CufileShim, ErrorNamesRoundTrip) {
  using hbmio::shim::cufile_error_name;
  EXPECT_STREQ(cufile_error_name(0), "CU_FILE_SUCCESS");
  EXPECT_STREQ(cufile_error_name(5001), "CU_FILE_DRIVER_NOT_INITIALIZED");
  EXPECT_STREQ(cufile_error_name(5011), "CU_FILE_CUDA_DRIVER_ERROR");
  EXPECT_STREQ(cufile_error_name(5027), "CU_FILE_HANDLE_NOT_REGISTERED");
  EXPECT_STREQ(cufile_error_name(5033), "CU_FILE_NVFS_SETUP_ERROR");
  EXPECT_STREQ(cufile_error_name(5049), "CU_FILE_BATCH_NOCOMPAT_ERROR");
  // cuFileRead/Write return -code.
  EXPECT_STREQ(cufile_error_name(-5044), "CU_FILE_IO_ERROR");
  // Gaps in the numbering and errno values are not cuFile codes.
  EXPECT_EQ(cufile_error_name(5021), nullptr);
  EXPECT_EQ(cufile_error_name(5032), nullptr);
  EXPECT_EQ(cufile_error_name(EIO), nullptr);
  EXPECT_EQ(cufile_error_name(9999), nullptr);
}

TEST(CufileShim, EveryCodeHasAUniqueNameAndADescription) {
  std::vector<std::string> names;
  for (int code = hbmio::shim::kCufileOpBaseError + 1; code <= 5050; ++code) {
    if (code == 5021 || code == 5032) continue;
    const char* name = hbmio::shim::cufile_error_name(code);
    ASSERT_NE(name, nullptr) << code;
    EXPECT_EQ(std::string(name).rfind("CU_FILE_", 0), 0u) << name;
    EXPECT_NE(hbmio::shim::cufile_error_description(code), nullptr) << name;
    for (const auto& seen : names) EXPECT_NE(seen, name) << code;
    names.emplace_back(name);
  }
  EXPECT_EQ(names.size(), 48u);
}

TEST(CufileShim, CategoryMessagesNameTheCode) {
  const std::error_category& category = hbmio::cufile_category();
  EXPECT_STREQ(category.name(), "cufile");
  const std::string message = category.message(5027);
  EXPECT_EQ(message.rfind("CU_FILE_HANDLE_NOT_REGISTERED (5027): ", 0), 0u) << message;
  EXPECT_GT(message.size(), std::strlen("CU_FILE_HANDLE_NOT_REGISTERED (5027): ")) << "no description";
  EXPECT_EQ(category.message(-5027), message);
  EXPECT_EQ(category.message(0).rfind("CU_FILE_SUCCESS (0)", 0), 0u);
  // Below 5000 it is an errno value, as cuFileRead/Write report them.
  EXPECT_EQ(category.message(ENOENT), std::generic_category().message(ENOENT));
  EXPECT_TRUE(contains(category.message(5999), "unknown cuFile error (5999)"));
  // Conditions: errno values and the obvious cuFile twins compare equal to std::errc.
  EXPECT_EQ(std::error_code(EIO, category), std::errc::io_error);
  EXPECT_EQ(std::error_code(hbmio::shim::CU_FILE_IO_ERROR, category), std::errc::io_error);
  EXPECT_EQ(std::error_code(hbmio::shim::CU_FILE_PERMISSION_DENIED, category), std::errc::permission_denied);
  EXPECT_NE(std::error_code(hbmio::shim::CU_FILE_HANDLE_NOT_REGISTERED, category), std::errc::io_error);
}

TEST(CufileShim, DescribeIncludesTheCudaResult) {
  const std::string text = hbmio::shim::describe_cufile_error({hbmio::shim::CU_FILE_CUDA_DRIVER_ERROR, 201});
  EXPECT_TRUE(contains(text, "CU_FILE_CUDA_DRIVER_ERROR (5011)")) << text;
  EXPECT_TRUE(contains(text, "CUresult 201")) << text;
}

TEST(CufileShim, ErrorCarriesNameThroughHbmioError) {
  const hbmio::Error error(std::error_code(5027, hbmio::cufile_category()),
                           {.op = "read", .path = "/data/x", .offset = 4096, .length = 8192, .backend = "cufile"});
  const std::string what = error.what();
  for (const char* part : {"read", "/data/x", "4096", "8192", "cufile", "CU_FILE_HANDLE_NOT_REGISTERED", "5027"})
    EXPECT_TRUE(contains(what, part)) << part << " missing from: " << what;
}

// ---- loading --------------------------------------------------------------------------------------

TEST(CufileShim, MissingLibraryReportsEveryPathTried) {
  const std::vector<std::string> paths = {"/nonexistent/hbmio-a/libcufile.so.0", "/nonexistent/hbmio-b/libcufile.so.0"};
  const auto api = CufileApi::load(paths);
  EXPECT_FALSE(api->loaded());
  EXPECT_EQ(api->tried(), paths);
  for (const auto& path : paths) EXPECT_TRUE(contains(api->load_error(), path)) << api->load_error();
  EXPECT_TRUE(contains(api->load_error(), "No such file")) << "dlerror() text expected: " << api->load_error();
  EXPECT_EQ(api->read, nullptr);
  EXPECT_EQ(api->driver_open, nullptr);
  EXPECT_TRUE(api->library_path().empty());
  EXPECT_EQ(api->version(), 0);
}

TEST(CufileShim, NoCandidatesIsAnError) {
  const auto api = CufileApi::load({});
  EXPECT_FALSE(api->loaded());
  EXPECT_FALSE(api->load_error().empty());
}

TEST(CufileShim, ALibraryWithoutTheEntryPointsIsRejected) {
  // libm loads fine but is not libcufile: it must be closed again and named with the symbol.
  const auto api = CufileApi::load({"libm.so.6"});
  EXPECT_FALSE(api->loaded());
  EXPECT_TRUE(contains(api->load_error(), "libm.so.6")) << api->load_error();
  EXPECT_TRUE(contains(api->load_error(), "cuFileDriverOpen")) << api->load_error();
  EXPECT_EQ(api->handle_register, nullptr);
}

TEST(CufileShim, ExplicitLibraryIsTheOnlyCandidate) {
  {
    const ScopedEnv env("HBMIO_CUFILE_LIBRARY", "/nonexistent/explicit/libcufile.so.0");
    EXPECT_EQ(CufileApi::default_candidates(), std::vector<std::string>{"/nonexistent/explicit/libcufile.so.0"});
    const auto api = CufileApi::load(CufileApi::default_candidates());
    EXPECT_FALSE(api->loaded());
    EXPECT_TRUE(contains(api->load_error(), "/nonexistent/explicit/libcufile.so.0")) << api->load_error();
  }
  const ScopedEnv env("HBMIO_CUFILE_LIBRARY", nullptr);
  const auto candidates = CufileApi::default_candidates();
  ASSERT_GE(candidates.size(), 2u);
  EXPECT_EQ(candidates[0], "libcufile.so.0");
  EXPECT_EQ(candidates[1], "/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.0");
}

// The command line finds the nvidia-cufile wheel of a Python environment as the Python package
// does (there torch has usually loaded it): here through $VIRTUAL_ENV, in both wheel layouts.
TEST(CufileShim, FindsTheWheelOfTheActivePythonEnvironment) {
  const hbmio::test::TempDir env;
  const std::string cu13 = env.file("lib/python3.12/site-packages/nvidia/cu13/lib/libcufile.so.0");
  const std::string cu12 = env.file("lib/python3.12/site-packages/nvidia/cufile/lib/libcufile.so.0");
  for (const auto& path : {cu13, cu12}) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    hbmio::test::write_file(path, {});
  }
  const ScopedEnv explicit_library("HBMIO_CUFILE_LIBRARY", nullptr);
  const ScopedEnv venv("VIRTUAL_ENV", env.path().c_str());
  const auto candidates = CufileApi::default_candidates();
  EXPECT_NE(std::find(candidates.begin(), candidates.end(), cu13), candidates.end()) << fmt::format("{}", fmt::join(candidates, " "));
  EXPECT_NE(std::find(candidates.begin(), candidates.end(), cu12), candidates.end()) << fmt::format("{}", fmt::join(candidates, " "));
  EXPECT_EQ(candidates[0], "libcufile.so.0") << "the loader's own search (and a loaded copy) comes first";
}

TEST(CufileShim, LoadsARealLibrary) {
  // HBMIO_TEST_CUFILE_LIBRARY: set by the build to the nvidia-cufile wheel's library where one is
  // installed; otherwise the default search.
  const char* test_library = std::getenv("HBMIO_TEST_CUFILE_LIBRARY");
  const auto api = CufileApi::load(test_library && *test_library ? std::vector<std::string>{test_library}
                                                                  : CufileApi::default_candidates());
  if (!api->loaded()) GTEST_SKIP() << "no libcufile here: " << api->load_error();
  EXPECT_TRUE(api->load_error().empty());
  EXPECT_FALSE(api->library_path().empty());
  EXPECT_TRUE(fs::exists(api->library_path())) << api->library_path();
  for (const void* entry : {reinterpret_cast<const void*>(api->driver_open), reinterpret_cast<const void*>(api->driver_close),
                            reinterpret_cast<const void*>(api->driver_get_properties),
                            reinterpret_cast<const void*>(api->handle_register),
                            reinterpret_cast<const void*>(api->handle_deregister), reinterpret_cast<const void*>(api->read),
                            reinterpret_cast<const void*>(api->write), reinterpret_cast<const void*>(api->buf_register),
                            reinterpret_cast<const void*>(api->buf_deregister)})
    EXPECT_NE(entry, nullptr);
  if (api->get_version) {
    // major * 1000 + minor * 10, e.g. 1150 for GDS 1.15; no driver needed to ask.
    EXPECT_GE(api->version(), 1000);
    EXPECT_EQ(api->version_string(), std::to_string(api->version() / 1000) + "." + std::to_string(api->version() % 1000 / 10));
  }
  // cuFileDriverClose is #defined to cuFileDriverClose_v2 in cufile.h since GDS 1.4: that is the
  // one a compiled caller uses, so it must be the one bound.
  if (void* same = ::dlopen(api->library_path().c_str(), RTLD_NOW | RTLD_NOLOAD)) {
    if (void* v2 = ::dlsym(same, "cuFileDriverClose_v2")) {
      EXPECT_EQ(reinterpret_cast<void*>(api->driver_close), v2);
    }
    ::dlclose(same);
  }
}

TEST(CufileShim, EmptyFileHandleIsHarmless) {
  hbmio::shim::FileHandle handle;
  EXPECT_FALSE(handle);
  hbmio::shim::FileHandle moved(std::move(handle));
  EXPECT_FALSE(moved);
  moved.reset();
  // Registering through an unloaded library fails cleanly, without calling anything.
  const auto api = CufileApi::load({"/nonexistent/libcufile.so.0"});
  const auto status = hbmio::shim::FileHandle::register_fd(*api, 0, moved);
  EXPECT_EQ(status.err, hbmio::shim::CU_FILE_DRIVER_NOT_INITIALIZED);
  EXPECT_FALSE(moved);
}

// ---- the backend without a GPU ----------------------------------------------------------------------

TEST(CufileProbe, ProbeExplainsItself) {
  const hbmio::BackendStatus status = hbmio::detail::probe_cufile();
  EXPECT_EQ(status.name, "cufile");
  EXPECT_FALSE(status.detail.empty());
  if (hbmio::cuda_device_count() == 0) {
    EXPECT_FALSE(status.available);
    EXPECT_TRUE(contains(status.detail, "no CUDA device")) << status.detail;
  }
  if (!CufileApi::instance().loaded()) {
    EXPECT_FALSE(status.available);
    for (const auto& path : CufileApi::instance().tried()) EXPECT_TRUE(contains(status.detail, path)) << status.detail;
  }
  if (status.available) {
    EXPECT_TRUE(contains(status.detail, CufileApi::instance().library_path())) << status.detail;
  }
}

TEST(CufileProbe, MakeEngineWithoutADeviceIsNotSupported) {
  if (hbmio::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  try {
    (void)hbmio::make_engine("cufile", hbmio::Options{});
    FAIL() << "make_engine(\"cufile\") succeeded without a CUDA device";
  } catch (const hbmio::Error& e) {
    EXPECT_EQ(e.code(), hbmio::errno_code(ENOTSUP));
    EXPECT_EQ(e.context().backend, "cufile");
    EXPECT_EQ(e.context().op, "open backend");
    EXPECT_TRUE(contains(e.what(), "no CUDA device")) << e.what();
    // The same reason every time: the failure is remembered, not retried.
    EXPECT_EQ(e.detail(), hbmio::shim::DriverSession::acquire().reason());
  }
}

TEST(CufileProbe, VerdictWithoutADeviceSaysWhy) {
  if (hbmio::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  const TempFile temp(pattern(4096, 1));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  const hbmio::detail::CufileVerdict verdict = hbmio::detail::cufile_verdict(file);
  EXPECT_FALSE(verdict.usable);
  EXPECT_FALSE(verdict.direct);
  EXPECT_TRUE(verdict.mode.empty());
  EXPECT_TRUE(contains(verdict.reason, "no CUDA device")) << verdict.reason;
}

// The auto backend skips opening the cuFile driver where sysfs rules DMA out. A fake sysfs
// tree gives the temporary file's device each shape that matters.
TEST(CufileProbe, DmaIsRuledOutFromSysfsOnlyWhereNoPathCanExist) {
  const TempFile temp(pattern(4096, 3));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  struct stat st {};
  ASSERT_EQ(::fstat(file.fd(), &st), 0);
  const fs::path base = fs::path(temp.path()).string() + ".root";  // stands for "/"
  const fs::path sys = base / "sys";
  const hbmio::platform::Root root(base);
  struct Cleanup {
    fs::path p;
    ~Cleanup() { std::error_code ec; fs::remove_all(p, ec); }
  } cleanup{base};
  if (major(st.st_dev) == 0) {  // the test directory is on no block device (tmpfs, overlay)
    fs::create_directories(sys / "module");
    const auto why = hbmio::detail::cufile_dma_ruled_out(file, root);
    ASSERT_TRUE(why.has_value());
    EXPECT_TRUE(contains(*why, "no block device")) << *why;
    return;
  }
  const fs::path link = sys / "dev" / "block" / fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  fs::create_directories(link.parent_path());
  EXPECT_FALSE(hbmio::detail::cufile_dma_ruled_out(file, root).has_value()) << "no /sys/module: ask the driver";
  fs::create_directories(sys / "module");
  const auto device_is = [&](const std::string& device_dir) {
    std::error_code ec;
    fs::remove(link, ec);
    fs::create_directories(sys / device_dir);
    fs::create_directory_symlink(sys / device_dir, link);
    return hbmio::detail::cufile_dma_ruled_out(file, root);
  };
  EXPECT_FALSE(hbmio::detail::cufile_dma_ruled_out(file, root).has_value()) << "no entry: ask the driver";
  const auto virtio = device_is("devices/pci0000:00/0000:00:05.0/virtio3/block/vda/vda1");
  ASSERT_TRUE(virtio.has_value());
  EXPECT_TRUE(contains(*virtio, "vda1") && contains(*virtio, "not NVMe") && contains(*virtio, temp.path())) << *virtio;
  EXPECT_FALSE(device_is("devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1/nvme0n1p1").has_value());
  EXPECT_FALSE(device_is("devices/virtual/nvme-fabrics/ctl/nvme1/nvme1n1").has_value());
  EXPECT_FALSE(device_is("devices/virtual/block/dm-0").has_value());
  EXPECT_FALSE(device_is("devices/virtual/block/md0").has_value());
  ASSERT_TRUE(device_is("devices/platform/host0/target0:0:0/0:0:0:0/block/sda").has_value());
  fs::create_directories(base / "proc" / "driver" / "nvidia-fs");  // GDS present: only the driver knows
  EXPECT_FALSE(hbmio::detail::cufile_dma_ruled_out(file, root).has_value());
  fs::remove_all(base / "proc");
  fs::create_directories(sys / "module" / "nvidia_fs");
  EXPECT_FALSE(hbmio::detail::cufile_dma_ruled_out(file, root).has_value());
}

TEST(CufileProbe, HandleNotRegisteredIsDiagnosed) {
  // What the 5027 message says depends on the machine (udev database, file system); here it
  // must name udev and, unless the workaround is already on, the workaround.
  const TempFile temp(pattern(4096, 2));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  {
    const ScopedEnv env("CUFILE_EXPERIMENTAL_FS", nullptr);
    const std::string text = hbmio::detail::diagnose_handle_not_registered(file.fd());
    EXPECT_TRUE(contains(text, "udev")) << text;
    const bool looks_complete = contains(text, "looks complete");
    if (!looks_complete) {
      EXPECT_TRUE(contains(text, "CUFILE_EXPERIMENTAL_FS=1")) << text;
    }
    std::printf("5027 diagnosis for %s: %s\n", temp.path().c_str(), text.c_str());
  }
  const ScopedEnv env("CUFILE_EXPERIMENTAL_FS", "1");
  EXPECT_TRUE(contains(hbmio::detail::diagnose_handle_not_registered(file.fd()), "cause is elsewhere"));
}

// The way a cufile transfer takes, decided from what the driver reports (stated here, as the
// driver of each kind of machine would report it) and the file: no GPU or libcufile needed.
TEST(CufileProbe, TransferPlanNamesTheWayAndWhy) {
  using hbmio::DataPath;
  using hbmio::DirectIo;
  using hbmio::detail::CufileDriverFacts;
  const TempFile temp(pattern(1 << 20, 3));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  const std::string fs_type = hbmio::file_system_type(temp.path());
  if (fs_type != "ext4" && fs_type != "xfs") GTEST_SKIP() << "the test file is on " << fs_type << ", not a GDS file system";
  if (!file.direct_io().supported) GTEST_SKIP() << "no O_DIRECT here: " << file.direct_io().reason;
  const unsigned nvme = 1u << hbmio::shim::CU_FILE_NVME_SUPPORTED, nvme_p2p = 1u << hbmio::shim::CU_FILE_NVME_P2P_SUPPORTED;

  // nvidia-fs loaded and NVMe supported: DMA through nvidia-fs, on the O_DIRECT descriptor.
  // Stated field by field: the facts as cuFileDriverGetProperties would give them.
  const auto facts = [](bool nvidia_fs, bool p2pdma, unsigned flags) {
    CufileDriverFacts f;
    f.nvidia_fs = nvidia_fs;
    f.nvidia_fs_version = nvidia_fs ? "2.26" : "";
    f.p2pdma = p2pdma;
    f.has_properties = true;
    f.dstatusflags = flags;
    return f;
  };
  const CufileDriverFacts gds = facts(true, false, nvme);
  auto plan = hbmio::detail::plan_cufile_transfer(gds, file, DirectIo::automatic, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::gds_nvidia_fs);
  EXPECT_TRUE(plan.o_direct);
  EXPECT_EQ(plan.fd, file.direct_fd());
  EXPECT_EQ(plan.mode, "GDS (nvidia-fs 2.26)");

  // No nvidia-fs, P2PDMA selected and the driver serving NVMe through it.
  const CufileDriverFacts p2p = facts(false, true, nvme_p2p);
  plan = hbmio::detail::plan_cufile_transfer(p2p, file, DirectIo::automatic, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::gds_p2pdma);
  EXPECT_EQ(plan.mode, "P2PDMA");

  // Neither: compatibility mode, and why.
  const CufileDriverFacts neither = facts(false, false, 0);
  plan = hbmio::detail::plan_cufile_transfer(neither, file, DirectIo::automatic, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::cufile_compat);
  EXPECT_TRUE(contains(plan.mode, "no nvidia-fs / P2PDMA")) << plan.mode;

  // A driver that lists no back end for this file system (nvidia-fs without NVMe support).
  const CufileDriverFacts no_backend = facts(true, false, 0);
  plan = hbmio::detail::plan_cufile_transfer(no_backend, file, DirectIo::automatic, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::cufile_compat);
  EXPECT_TRUE(contains(plan.mode, fs_type + " is not a GDS file system here")) << plan.mode;

  // DMA possible, but O_DIRECT switched off by option, or no O_DIRECT descriptor at all.
  plan = hbmio::detail::plan_cufile_transfer(gds, file, DirectIo::off, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::cufile_compat);
  EXPECT_FALSE(plan.o_direct);
  EXPECT_TRUE(contains(plan.mode, "O_DIRECT off by option")) << plan.mode;
  const hbmio::File buffered = hbmio::File::open(temp.path(), hbmio::OpenMode::read, false);
  plan = hbmio::detail::plan_cufile_transfer(gds, buffered, DirectIo::automatic, 0, 1 << 20);
  EXPECT_EQ(plan.path, DataPath::cufile_compat);
  EXPECT_TRUE(contains(plan.mode, "no O_DIRECT descriptor: opened without O_DIRECT")) << plan.mode;
}

// Run by ctest with HBMIO_CUFILE_LIBRARY=/nonexistent/...: instance() is decided once per
// process, so this needs a process of its own.
TEST(CufileEnv, ProbeNamesTheExplicitLibrary) {
  const char* explicit_path = std::getenv("HBMIO_CUFILE_LIBRARY");
  if (explicit_path == nullptr || fs::exists(explicit_path))
    GTEST_SKIP() << "needs HBMIO_CUFILE_LIBRARY set to a path that does not exist (ctest test cufile_env_override)";
  const hbmio::BackendStatus status = hbmio::detail::probe_cufile();
  EXPECT_FALSE(status.available);
  EXPECT_TRUE(contains(status.detail, explicit_path)) << status.detail;
  EXPECT_TRUE(contains(status.detail, "HBMIO_CUFILE_LIBRARY")) << status.detail;
  EXPECT_FALSE(contains(status.detail, "/usr/local/cuda/targets")) << "fell back to another library: " << status.detail;
}

// ---- with a GPU ---------------------------------------------------------------------------------------

class CufileGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (hbmio::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: " << hbmio::cuda_unavailable_reason();
  }

  // The engine, or null after checking that the reason names what failed. The test then skips
  // with that reason: no data was moved, so nothing more can be checked.
  std::unique_ptr<hbmio::Engine> engine(hbmio::Options options, std::shared_ptr<hbmio::FaultInjector> faults = nullptr) {
    try {
      return hbmio::detail::make_engine_with_faults("cufile", options, std::move(faults));
    } catch (const hbmio::Error& e) {
      EXPECT_EQ(e.code(), hbmio::errno_code(ENOTSUP)) << e.what();
      const auto& session = hbmio::shim::DriverSession::acquire();
      EXPECT_FALSE(session.ok());
      if (session.error().category() == hbmio::cufile_category()) {
        EXPECT_TRUE(contains(e.what(), hbmio::shim::cufile_error_name(session.error().value()))) << e.what();
      } else {
        EXPECT_TRUE(contains(e.what(), "libcufile")) << e.what();
      }
      skip_reason_ = e.what();
      return nullptr;
    }
  }

  // For an Error thrown by a transfer before any data moved: it must name the cuFile code.
  void expect_names_cufile_code(const hbmio::Error& e) {
    ASSERT_EQ(e.code().category(), hbmio::cufile_category()) << e.what();
    const char* name = hbmio::shim::cufile_error_name(e.code().value());
    ASSERT_NE(name, nullptr) << e.what();
    EXPECT_TRUE(contains(e.what(), name)) << e.what();
    EXPECT_TRUE(contains(e.what(), "cuFileHandleRegister")) << e.what();
    if (e.code().value() == hbmio::shim::CU_FILE_HANDLE_NOT_REGISTERED) {
      EXPECT_TRUE(contains(e.what(), "CUFILE_EXPERIMENTAL_FS") || contains(e.what(), "CUFILE_LOGGING_LEVEL")) << e.what();
    }
  }

  static hbmio::Options small_chunks() {
    hbmio::Options options;
    options.chunk_size = std::size_t{1} << 20;  // several pieces on several workers
    options.bounce_buffer_size = std::size_t{256} << 10;
    options.workers = 4;
    return options;
  }

  std::string skip_reason_;
};

TEST_F(CufileGpu, ReadsAFileIntoDeviceMemory) {
  const std::size_t size = (std::size_t{5} << 20) + 12345;  // not a multiple of the chunk or 4 KiB
  const std::vector<std::byte> expected = pattern(size, 42);
  const TempFile temp(expected);
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  auto cufile = engine(small_chunks());
  if (!cufile) GTEST_SKIP() << skip_reason_;

  hbmio::Buffer device = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, size);
  hbmio::fill_memory(device.span(), std::byte{0});
  std::atomic<std::uint64_t> progress{0};
  hbmio::Stats stats;
  try {
    stats = cufile->submit({.op = hbmio::IoOp::read, .file = &file, .offset = 0, .memory = device.span(), .progress = &progress});
  } catch (const hbmio::Error& e) {
    expect_names_cufile_code(e);
    GTEST_SKIP() << "cuFile could not register the file: " << e.what();
  }
  EXPECT_EQ(stats.backend, "cufile");
  EXPECT_EQ(stats.bytes, size);
  EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, size);
  EXPECT_EQ(progress.load(), size);
  EXPECT_GE(stats.workers, 1u);
  EXPECT_FALSE(stats.note.empty());

  hbmio::Buffer host = hbmio::Buffer::allocate({hbmio::MemoryKind::host, 0}, size);
  hbmio::copy_memory(host.span(), device.span());
  ASSERT_EQ(std::memcmp(host.data(), expected.data(), size), 0);

  // An unaligned range into the middle of the buffer.
  const std::uint64_t offset = 4099;
  const std::size_t length = std::size_t{2} << 20;
  hbmio::fill_memory(device.span(), std::byte{0});
  cufile->read(file, offset, device.span().subspan(8192, length));
  hbmio::copy_memory(host.span(), device.span());
  EXPECT_EQ(std::memcmp(host.data() + 8192, expected.data() + offset, length), 0);
  EXPECT_EQ(host.data()[8191], std::byte{0});
  EXPECT_EQ(host.data()[8192 + length], std::byte{0});
}

TEST_F(CufileGpu, WritesDeviceMemoryToAFile) {
  const std::size_t size = (std::size_t{3} << 20) + 777;
  const std::vector<std::byte> expected = pattern(size, 7);
  const TempFile temp({});
  auto cufile = engine(small_chunks());
  if (!cufile) GTEST_SKIP() << skip_reason_;

  hbmio::Buffer host = hbmio::Buffer::allocate({hbmio::MemoryKind::host, 0}, size);
  std::memcpy(host.data(), expected.data(), size);
  hbmio::Buffer device = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, size);
  hbmio::copy_memory(device.span(), host.span());
  {
    const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read_write);
    try {
      const hbmio::Stats stats = cufile->write(file, 0, device.span());
      EXPECT_EQ(stats.bytes, size);
    } catch (const hbmio::Error& e) {
      expect_names_cufile_code(e);
      GTEST_SKIP() << "cuFile could not register the file: " << e.what();
    }
    file.sync();
  }
  const std::vector<std::byte> written = temp.read_back();
  ASSERT_EQ(written.size(), size);
  EXPECT_EQ(std::memcmp(written.data(), expected.data(), size), 0);
}

TEST_F(CufileGpu, ConcurrentTransfersShareOneFile) {
  // cuFile refuses a second registration of one descriptor; two engines reading the same File at
  // once (and a verdict meanwhile) must share it.
  const std::size_t size = std::size_t{8} << 20;
  const std::vector<std::byte> expected = pattern(size, 23);
  const TempFile temp(expected);
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  auto first = engine(small_chunks());
  if (!first) GTEST_SKIP() << skip_reason_;
  auto second = engine(small_chunks());
  ASSERT_NE(second, nullptr);
  hbmio::Buffer a = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, size);
  hbmio::Buffer b = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, size);
  auto fa = first->submit_async({.op = hbmio::IoOp::read, .file = &file, .offset = 0, .memory = a.span(), .progress = nullptr});
  auto fb = second->submit_async({.op = hbmio::IoOp::read, .file = &file, .offset = 0, .memory = b.span(), .progress = nullptr});
  const hbmio::detail::CufileVerdict verdict = hbmio::detail::cufile_verdict(file);
  // Wait for both before looking at errors: the buffers must outlive both transfers.
  std::optional<hbmio::Error> failure;
  for (auto* future : {&fa, &fb}) {
    try {
      future->get();
    } catch (const hbmio::Error& e) {
      if (!failure) failure.emplace(e);
    }
  }
  if (failure) {
    expect_names_cufile_code(*failure);
    EXPECT_NE(failure->code().value(), hbmio::shim::CU_FILE_HANDLE_ALREADY_REGISTERED) << failure->what();
    GTEST_SKIP() << "cuFile could not register the file: " << failure->what();
  }
  EXPECT_TRUE(verdict.usable) << verdict.reason;
  hbmio::Buffer host = hbmio::Buffer::allocate({hbmio::MemoryKind::host, 0}, size);
  for (const hbmio::Buffer* device : {&a, &b}) {
    hbmio::copy_memory(host.span(), device->span());
    EXPECT_EQ(std::memcmp(host.data(), expected.data(), size), 0);
  }
}

TEST_F(CufileGpu, RefusesHostMemory) {
  const TempFile temp(pattern(8192, 3));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  auto cufile = engine(hbmio::Options{});
  if (!cufile) GTEST_SKIP() << skip_reason_;
  for (const auto kind : {hbmio::MemoryKind::host, hbmio::MemoryKind::pinned}) {
    hbmio::Buffer host = hbmio::Buffer::allocate({kind, 0}, 8192);
    try {
      cufile->read(file, 0, host.span());
      ADD_FAILURE() << "cufile read into " << host.location().to_string() << " memory";
    } catch (const hbmio::Error& e) {
      EXPECT_EQ(e.code(), hbmio::errno_code(ENOTSUP));
      EXPECT_TRUE(contains(e.what(), "device memory only")) << e.what();
    }
  }
}

TEST_F(CufileGpu, SurvivesShortTransfersAndRetries) {
  const std::size_t size = std::size_t{4} << 20;
  const std::vector<std::byte> expected = pattern(size, 11);
  const TempFile temp(expected);
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  auto faults = std::make_shared<hbmio::FaultInjector>(
      hbmio::FaultPlan{.seed = 5, .short_probability = 0.5, .eagain_count = 2, .eintr_count = 2});
  auto cufile = engine(small_chunks(), faults);
  if (!cufile) GTEST_SKIP() << skip_reason_;
  hbmio::Buffer device = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, size);
  try {
    cufile->read(file, 0, device.span());
  } catch (const hbmio::Error& e) {
    expect_names_cufile_code(e);
    GTEST_SKIP() << "cuFile could not register the file: " << e.what();
  }
  hbmio::Buffer host = hbmio::Buffer::allocate({hbmio::MemoryKind::host, 0}, size);
  hbmio::copy_memory(host.span(), device.span());
  EXPECT_EQ(std::memcmp(host.data(), expected.data(), size), 0);
  EXPECT_FALSE(faults->log().empty());
}

TEST_F(CufileGpu, FailedSetupIsReportedAndLeaksNothing) {
  const TempFile temp(pattern(65536, 13));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  hbmio::Buffer device = hbmio::Buffer::allocate({hbmio::MemoryKind::device, 0}, 65536);
  const hbmio::MemoryCounters before = hbmio::memory_counters();
  // Call 1 is the handle registration; call 2 the first cuFileRead.
  for (std::uint64_t call : {1u, 2u}) {
    auto faults = std::make_shared<hbmio::FaultInjector>(hbmio::FaultPlan{.seed = 1, .fail_call = call, .fail_errno = EIO});
    auto cufile = engine(hbmio::Options{}, faults);
    if (!cufile) GTEST_SKIP() << skip_reason_;
    try {
      cufile->read(file, 0, device.span());
      ADD_FAILURE() << "no error with fail_call " << call;
    } catch (const hbmio::Error& e) {
      if (e.code().category() == hbmio::cufile_category()) {
        expect_names_cufile_code(e);  // real registration failure: the injected one never ran
        GTEST_SKIP() << e.what();
      }
      EXPECT_EQ(e.code(), hbmio::errno_code(EIO)) << e.what();
      EXPECT_TRUE(contains(e.what(), call == 1 ? "cuFileHandleRegister" : "cuFileRead")) << e.what();
      EXPECT_TRUE(faults->fired());
    }
  }
  const hbmio::MemoryCounters after = hbmio::memory_counters();
  EXPECT_EQ(after.device_buffers, before.device_buffers);
  EXPECT_EQ(after.pinned_buffers, before.pinned_buffers);
}

TEST_F(CufileGpu, VerdictIsUsableOrSaysWhy) {
  const TempFile temp(pattern(4096, 17));
  const hbmio::File file = hbmio::File::open(temp.path(), hbmio::OpenMode::read);
  const hbmio::detail::CufileVerdict verdict = hbmio::detail::cufile_verdict(file);
  if (verdict.usable) {
    EXPECT_FALSE(verdict.mode.empty());
    EXPECT_TRUE(verdict.reason.empty());
    if (!verdict.direct) {
      EXPECT_TRUE(contains(verdict.mode, "compatibility mode")) << verdict.mode;
    }
  } else {
    EXPECT_FALSE(verdict.direct);
    EXPECT_TRUE(contains(verdict.reason, "CU_FILE_") || contains(verdict.reason, "libcufile")) << verdict.reason;
  }
  const hbmio::BackendStatus status = hbmio::detail::probe_cufile();
  if (status.available) {
    EXPECT_TRUE(contains(status.detail, "driver open")) << status.detail;
  }
  std::printf("cufile verdict for %s: %s\nprobe: %s\n", temp.path().c_str(),
              verdict.usable ? verdict.mode.c_str() : verdict.reason.c_str(), status.detail.c_str());
}

}  // namespace
