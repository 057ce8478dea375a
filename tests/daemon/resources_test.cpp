// Tests of NVML loading (NvmlTest) and node resource discovery (ResourcesTest), against
// tests/daemon/fake_nvml.cpp: a library that pretends to be NVML on a node with H200 GPUs and
// whose behaviour the TESSERA_FAKE_NVML_* variables steer.
#include "daemon/resources.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <stdlib.h>
#include <cstdlib>

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "daemon/nvml.h"

#ifndef TESSERA_FAKE_NVML_PATH
#error "TESSERA_FAKE_NVML_PATH must name the fake NVML library"
#endif

namespace tessera {
namespace {

// The build's path, unless $TESSERA_TEST_DIR says where the test binaries were copied (as
// scripts/gpu-check does on the GPU machine).
const std::string& fake_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TESSERA_TEST_DIR");
    return dir != nullptr ? std::string(dir) + "/libtessera_fake_nvml.so"
                          : std::string(TESSERA_FAKE_NVML_PATH);
  }();
  return path;
}
const char* const kFake = fake_path().c_str();
constexpr uint64_t kMiB = 1024 * 1024;

// Sets environment variables for one test and restores what was there before. Starts by
// clearing everything that steers NVML loading or the fake, so the outer environment cannot leak
// into a test.
class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* name :
         {"TESSERA_NVML_LIBRARY", "TESSERA_FAKE_NVML_INIT_FAIL", "TESSERA_FAKE_NVML_GPUS",
          "TESSERA_FAKE_NVML_TOPOLOGY", "TESSERA_FAKE_NVML_SWITCH_LINKS",
          "TESSERA_FAKE_NVML_NO_REMOTE_TYPE", "TESSERA_FAKE_NVML_ANCESTOR",
          "TESSERA_FAKE_NVML_USED_MIB", "TESSERA_FAKE_NVML_FAIL"}) {
      unset(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value.has_value()) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void set(const std::string& name, const std::string& value) {
    save(name);
    setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(const std::string& name) {
    save(name);
    unsetenv(name.c_str());
  }

 private:
  void save(const std::string& name) {
    if (saved_.count(name) != 0) return;
    const char* value = std::getenv(name.c_str());
    saved_[name] = value != nullptr ? std::optional<std::string>(value) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

// nvmlInit_v2 calls not yet matched by nvmlShutdown, as the fake counts them.
int fake_live_inits() {
  void* handle = dlopen(kFake, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    ADD_FAILURE() << dlerror();
    return -1;
  }
  auto live = reinterpret_cast<int (*)()>(dlsym(handle, "tessera_fake_nvml_live_inits"));
  int result = live != nullptr ? live() : -1;
  dlclose(handle);
  return result;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ---- Nvml --------------------------------------------------------------------------------

TEST(NvmlTest, ReadsDevicesOfTheFake) {
  ScopedEnv env;
  auto nvml = Nvml::open(kFake);
  ASSERT_TRUE(nvml.has_value()) << nvml.status().to_string();
  EXPECT_EQ((*nvml)->library(), kFake);
  EXPECT_TRUE((*nvml)->has_nvlink_api());

  auto version = (*nvml)->driver_version();
  ASSERT_TRUE(version.has_value());
  EXPECT_EQ(*version, "580.159.04");
  auto count = (*nvml)->device_count();
  ASSERT_TRUE(count.has_value());
  EXPECT_EQ(*count, 2u);

  auto device = (*nvml)->device(1);
  ASSERT_TRUE(device.has_value());
  EXPECT_EQ((*nvml)->name(*device).value(), "NVIDIA H200");
  EXPECT_EQ((*nvml)->uuid(*device).value(), "GPU-5e1f0c2a-8d43-4b7e-9a16-3c0d7e2b9001");
  auto pci = (*nvml)->pci_info(*device);
  ASSERT_TRUE(pci.has_value());
  EXPECT_EQ(pci->bus_id, "00000000:2A:00.0");
  EXPECT_EQ(pci->bus, 0x2au);
  EXPECT_EQ(pci->pci_device_id, 0x233510deu);
  auto memory = (*nvml)->memory(*device);
  ASSERT_TRUE(memory.has_value());
  EXPECT_EQ(memory->total, 143771 * kMiB);
  EXPECT_EQ(memory->used, 512 * kMiB);
  EXPECT_EQ(memory->free, memory->total - memory->used);

  EXPECT_EQ((*nvml)->device(2).status().code(), Code::kInvalidArgument);
}

TEST(NvmlTest, ReadsNvlinks) {
  ScopedEnv env;
  auto nvml = Nvml::open(kFake);
  ASSERT_TRUE(nvml.has_value()) << nvml.status().to_string();
  NvmlDevice gpu0 = (*nvml)->device(0).value();
  EXPECT_EQ((*nvml)->nvlink_state(gpu0, 0).value(), NvlinkState::kActive);
  EXPECT_EQ((*nvml)->nvlink_state(gpu0, 17).value(), NvlinkState::kActive);
  // Like driver 580, the fake knows 18 links: higher indexes are absent, not errors.
  EXPECT_EQ((*nvml)->nvlink_state(gpu0, 18).value(), NvlinkState::kAbsent);
  EXPECT_EQ((*nvml)->nvlink_state(gpu0, kNvmlMaxNvlinks - 1).value(), NvlinkState::kAbsent);
  auto remote = (*nvml)->nvlink_remote_pci(gpu0, 3);
  ASSERT_TRUE(remote.has_value());
  EXPECT_EQ(remote->bus_id, "00000000:2a:00.0");
  EXPECT_EQ((*nvml)->nvlink_remote_type(gpu0, 3).value(), NvlinkRemote::kGpu);
  NvmlDevice gpu1 = (*nvml)->device(1).value();
  EXPECT_EQ((*nvml)->common_ancestor(gpu0, gpu1).value(), NvmlTopologyLevel::kHostBridge);
}

TEST(NvmlTest, NoNvlinkIsAbsentNotAnError) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_TOPOLOGY", "pcie");
  auto nvml = Nvml::open(kFake);
  ASSERT_TRUE(nvml.has_value()) << nvml.status().to_string();
  NvmlDevice gpu0 = (*nvml)->device(0).value();
  EXPECT_EQ((*nvml)->nvlink_state(gpu0, 0).value(), NvlinkState::kAbsent);
}

TEST(NvmlTest, ShutsDownWhenDestroyed) {
  ScopedEnv env;
  {
    auto nvml = Nvml::open(kFake);
    ASSERT_TRUE(nvml.has_value()) << nvml.status().to_string();
    EXPECT_EQ(fake_live_inits(), 1);
  }
  EXPECT_EQ(fake_live_inits(), 0);
}

TEST(NvmlTest, EnvironmentChoosesLibraryAndArgumentWins) {
  ScopedEnv env;
  env.set("TESSERA_NVML_LIBRARY", kFake);
  auto from_env = Nvml::open();
  ASSERT_TRUE(from_env.has_value()) << from_env.status().to_string();
  EXPECT_EQ((*from_env)->library(), kFake);

  env.set("TESSERA_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1");
  auto from_argument = Nvml::open(kFake);
  ASSERT_TRUE(from_argument.has_value()) << from_argument.status().to_string();
  EXPECT_EQ((*from_argument)->library(), kFake);
  EXPECT_EQ(Nvml::open().status().code(), Code::kNotFound);
}

TEST(NvmlTest, MissingLibraryIsNotFound) {
  ScopedEnv env;
  auto nvml = Nvml::open("/nonexistent/libnvidia-ml.so.1");
  ASSERT_FALSE(nvml.has_value());
  EXPECT_EQ(nvml.status().code(), Code::kNotFound);
  EXPECT_EQ(nvml.status().message(), "no NVIDIA driver: /nonexistent/libnvidia-ml.so.1 not found");
}

TEST(NvmlTest, FileThatIsNotALibraryIsUnavailable) {
  ScopedEnv env;
  std::string path = ::testing::TempDir() + "nvml_test_not_a_library.so";
  std::FILE* file = std::fopen(path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  std::fputs("not an ELF file\n", file);
  std::fclose(file);
  auto nvml = Nvml::open(path);
  std::remove(path.c_str());
  ASSERT_FALSE(nvml.has_value());
  EXPECT_EQ(nvml.status().code(), Code::kUnavailable);
  EXPECT_TRUE(contains(nvml.status().message(), "cannot load " + path + ": "))
      << nvml.status().message();
}

TEST(NvmlTest, LibraryWithoutNvmlSymbolsIsRefused) {
  ScopedEnv env;
  auto nvml = Nvml::open("libm.so.6");
  ASSERT_FALSE(nvml.has_value());
  EXPECT_EQ(nvml.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(contains(nvml.status().message(), "libm.so.6 lacks nvmlInit_v2"))
      << nvml.status().message();
}

TEST(NvmlTest, InitFailureCarriesNvmlErrorString) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_INIT_FAIL", "1");
  auto nvml = Nvml::open(kFake);
  ASSERT_FALSE(nvml.has_value());
  EXPECT_EQ(nvml.status().code(), Code::kUnavailable);
  EXPECT_EQ(nvml.status().message(),
            "NVML initialization failed: nvmlInit_v2: Driver Not Loaded (NVML error 9)");
  EXPECT_EQ(fake_live_inits(), 0);
}

TEST(NvmlTest, FailedCallNamesFunctionAndNvmlError) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetMemoryInfo@1");
  auto nvml = Nvml::open(kFake);
  ASSERT_TRUE(nvml.has_value()) << nvml.status().to_string();
  EXPECT_TRUE((*nvml)->memory((*nvml)->device(0).value()).has_value());
  auto memory = (*nvml)->memory((*nvml)->device(1).value());
  ASSERT_FALSE(memory.has_value());
  EXPECT_EQ(memory.status().code(), Code::kInternal);
  EXPECT_EQ(memory.status().message(), "nvmlDeviceGetMemoryInfo: Unknown Error (NVML error 999)");
}

// ---- Resources ---------------------------------------------------------------------------

// The kinds of the link matrix, row by row, as link_name spells them.
std::vector<std::string> link_names(const NodeResources& r) {
  std::vector<std::string> out;
  for (const GpuLink& link : r.links) out.push_back(link_name(link));
  return out;
}

TEST(ResourcesTest, DiscoversGpusThroughTheFake) {
  ScopedEnv env;
  NodeResources r = discover_resources(kFake);
  EXPECT_EQ(r.gpu_note, "");
  EXPECT_EQ(r.driver_version, "580.159.04");
  EXPECT_EQ(r.cuda_version, "13.0");
  ASSERT_EQ(r.gpus.size(), 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r.gpus[i].index, i);
    EXPECT_EQ(r.gpus[i].name, "NVIDIA H200");
    EXPECT_EQ(r.gpus[i].memory_total, 143771 * kMiB);
    EXPECT_EQ(r.gpus[i].memory_used, 512 * kMiB);
  }
  EXPECT_NE(r.gpus[0].uuid, r.gpus[1].uuid);
  EXPECT_EQ(r.gpus[0].uuid.rfind("GPU-", 0), 0u);
  EXPECT_EQ(r.gpus[0].pci_bus_id, "00000000:18:00.0");
  EXPECT_EQ(r.gpus[1].pci_bus_id, "00000000:2A:00.0");

  ASSERT_EQ(r.links.size(), 4u);
  EXPECT_EQ(gpu_link(r, 0, 0).kind, LinkKind::kSelf);
  EXPECT_EQ(gpu_link(r, 1, 1).kind, LinkKind::kSelf);
  EXPECT_EQ(gpu_link(r, 0, 1).kind, LinkKind::kNvlink);
  EXPECT_EQ(gpu_link(r, 0, 1).nvlinks, 18u);
  EXPECT_EQ(gpu_link(r, 1, 0).kind, LinkKind::kNvlink);
  EXPECT_EQ(gpu_link(r, 1, 0).nvlinks, 18u);
  EXPECT_EQ(fake_live_inits(), 0);  // discover_resources does not keep NVML open
}

TEST(ResourcesTest, FormatsLinkMatrixLikeNvidiaSmi) {
  ScopedEnv env;
  NodeResources r = discover_resources(kFake);
  EXPECT_EQ(format_link_matrix(r),
            "      GPU0  GPU1\n"
            "GPU0  X     NV18\n"
            "GPU1  NV18  X\n");
  EXPECT_EQ(format_link_matrix(NodeResources{}), "");
}

TEST(ResourcesTest, PcieOnlyTopologyUsesCommonAncestor) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_TOPOLOGY", "pcie");
  NodeResources r = discover_resources(kFake);
  EXPECT_EQ(r.gpu_note, "");
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "PHB", "PHB", "X"}));
  EXPECT_EQ(gpu_link(r, 0, 1).nvlinks, 0u);
  EXPECT_EQ(format_link_matrix(r),
            "      GPU0  GPU1\n"
            "GPU0  X     PHB\n"
            "GPU1  PHB   X\n");
}

TEST(ResourcesTest, AncestorLevelsMapToPcieKinds) {
  const std::map<std::string, std::string> expected = {{"0", "PIX"},  {"10", "PIX"},  {"20", "PXB"},
                                                       {"30", "PHB"}, {"40", "NODE"}, {"50", "SYS"},
                                                       {"77", "N/A"}};
  for (const auto& [level, name] : expected) {
    ScopedEnv env;
    env.set("TESSERA_FAKE_NVML_TOPOLOGY", "pcie");
    env.set("TESSERA_FAKE_NVML_ANCESTOR", level);
    NodeResources r = discover_resources(kFake);
    ASSERT_EQ(r.gpus.size(), 2u);
    EXPECT_EQ(link_name(gpu_link(r, 0, 1)), name) << "level " << level;
    EXPECT_EQ(link_name(gpu_link(r, 1, 0)), name) << "level " << level;
  }
}

TEST(ResourcesTest, NvlinkPairsAndPcieBetweenThem) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_GPUS", "3");  // GPU0-GPU1 NVLinked, GPU2's links down
  NodeResources r = discover_resources(kFake);
  EXPECT_EQ(r.gpu_note, "");
  ASSERT_EQ(r.gpus.size(), 3u);
  EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "NV18", "SYS",  //
                                                     "NV18", "X", "SYS",  //
                                                     "SYS", "SYS", "X"}));
}

TEST(ResourcesTest, NvswitchConnectsEveryPairWithTheSmallerLinkCount) {
  for (const char* remote_type : {"0", "1"}) {  // with and without the remote-type query
    ScopedEnv env;
    env.set("TESSERA_FAKE_NVML_TOPOLOGY", "nvswitch");
    env.set("TESSERA_FAKE_NVML_GPUS", "4");
    env.set("TESSERA_FAKE_NVML_SWITCH_LINKS", "18,18,12,0");  // GPU3's NVLinks are all down
    env.set("TESSERA_FAKE_NVML_NO_REMOTE_TYPE", remote_type);
    NodeResources r = discover_resources(kFake);
    EXPECT_EQ(r.gpu_note, "");
    ASSERT_EQ(r.gpus.size(), 4u);
    EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "NV18", "NV12", "SYS",  //
                                                       "NV18", "X", "NV12", "SYS",  //
                                                       "NV12", "NV12", "X", "PHB",  //
                                                       "SYS", "SYS", "PHB", "X"}))
        << "NO_REMOTE_TYPE=" << remote_type;
  }
}

TEST(ResourcesTest, InitFailureGivesZeroGpusAndTheReason) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_INIT_FAIL", "1");
  NodeResources r = discover_resources(kFake);
  EXPECT_TRUE(r.gpus.empty());
  EXPECT_TRUE(r.links.empty());
  EXPECT_EQ(r.driver_version, "");
  EXPECT_TRUE(contains(r.gpu_note, "Driver Not Loaded")) << r.gpu_note;
  EXPECT_GE(r.cpus, 1u);  // the host part stands
  EXPECT_EQ(format_link_matrix(r), "");
}

TEST(ResourcesTest, MissingLibraryGivesZeroGpusAndNotFound) {
  ScopedEnv env;
  NodeResources r = discover_resources("/nonexistent/dir/libnvidia-ml.so.1");
  EXPECT_TRUE(r.gpus.empty());
  EXPECT_TRUE(r.links.empty());
  EXPECT_EQ(r.gpu_note, "no NVIDIA driver: /nonexistent/dir/libnvidia-ml.so.1 not found");
}

TEST(ResourcesTest, DefaultLibraryGivesGpusOrAReason) {
  ScopedEnv env;  // no TESSERA_NVML_LIBRARY: the real libnvidia-ml.so.1, if there is one
  NodeResources r = discover_resources();
  if (r.gpus.empty()) {
    EXPECT_FALSE(r.gpu_note.empty());
  } else {
    EXPECT_EQ(r.links.size(), r.gpus.size() * r.gpus.size());
    EXPECT_FALSE(r.driver_version.empty());
  }
}

TEST(ResourcesTest, HostHasCpusAndMemory) {
  ScopedEnv env;
  NodeResources r = discover_resources("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(r.hostname.empty());
  EXPECT_GE(r.cpus, 1u);
  EXPECT_GT(r.memory_total, 0u);
  EXPECT_GT(r.memory_available, 0u);
  EXPECT_LE(r.memory_available, r.memory_total);
}

TEST(ResourcesTest, GpuCountOfZero) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_GPUS", "0");
  NodeResources r = discover_resources(kFake);
  EXPECT_TRUE(r.gpus.empty());
  EXPECT_EQ(r.driver_version, "580.159.04");
  EXPECT_EQ(r.gpu_note, "NVML reports no GPUs");
}

TEST(ResourcesTest, FailedFieldQueryKeepsTheGpu) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetUUID@1");
  NodeResources r = discover_resources(kFake);
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_FALSE(r.gpus[0].uuid.empty());
  EXPECT_EQ(r.gpus[1].uuid, "");
  EXPECT_EQ(r.gpus[1].name, "NVIDIA H200");
  EXPECT_EQ(r.gpu_note, "GPU1: nvmlDeviceGetUUID: Unknown Error (NVML error 999)");
  EXPECT_EQ(link_name(gpu_link(r, 0, 1)), "NV18");
}

TEST(ResourcesTest, FailedHandleSkipsOnlyThatGpu) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetHandleByIndex_v2@0");
  NodeResources r = discover_resources(kFake);
  ASSERT_EQ(r.gpus.size(), 1u);
  EXPECT_EQ(r.gpus[0].index, 1u);
  EXPECT_TRUE(contains(r.gpu_note, "GPU0 skipped: nvmlDeviceGetHandleByIndex_v2: Unknown Error"))
      << r.gpu_note;
  EXPECT_EQ(format_link_matrix(r),
            "      GPU1\n"
            "GPU1  X\n");
}

TEST(ResourcesTest, NvlinkSeenFromOneSideIsEnough) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetNvLinkRemotePciInfo_v2@0");
  NodeResources r = discover_resources(kFake);
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "NV18", "NV18", "X"}));
  EXPECT_EQ(r.gpu_note,
            "GPU0 NVLink 0: nvmlDeviceGetNvLinkRemotePciInfo_v2: Unknown Error (NVML error 999)"
            " (and 17 more links)");
}

TEST(ResourcesTest, FailedNvlinkScanWithoutNvlinkIsUnknown) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_TOPOLOGY", "pcie");
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetNvLinkState@0");
  NodeResources r = discover_resources(kFake);
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "N/A", "N/A", "X"}));
  // One note for the GPU, not one per link.
  EXPECT_EQ(r.gpu_note, "GPU0 NVLink 0: nvmlDeviceGetNvLinkState: Unknown Error (NVML error 999)");
}

TEST(ResourcesTest, FailedCommonAncestorIsUnknown) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_TOPOLOGY", "pcie");
  env.set("TESSERA_FAKE_NVML_GPUS", "3");
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetTopologyCommonAncestor@2");
  NodeResources r = discover_resources(kFake);
  ASSERT_EQ(r.gpus.size(), 3u);
  EXPECT_EQ(link_names(r), (std::vector<std::string>{"X", "PHB", "N/A",  //
                                                     "PHB", "X", "N/A",  //
                                                     "N/A", "N/A", "X"}));
  EXPECT_TRUE(contains(r.gpu_note, "GPU0-GPU2: nvmlDeviceGetTopologyCommonAncestor: Unknown"))
      << r.gpu_note;
  EXPECT_TRUE(contains(r.gpu_note, "GPU1-GPU2: ")) << r.gpu_note;
}

TEST(ResourcesTest, LinkNames) {
  EXPECT_EQ(link_name({LinkKind::kSelf, 0}), "X");
  EXPECT_EQ(link_name({LinkKind::kNvlink, 4}), "NV4");
  EXPECT_EQ(link_name({LinkKind::kPix, 0}), "PIX");
  EXPECT_EQ(link_name({LinkKind::kPxb, 0}), "PXB");
  EXPECT_EQ(link_name({LinkKind::kPhb, 0}), "PHB");
  EXPECT_EQ(link_name({LinkKind::kNode, 0}), "NODE");
  EXPECT_EQ(link_name({LinkKind::kSys, 0}), "SYS");
  EXPECT_EQ(link_name({LinkKind::kUnknown, 0}), "N/A");
}

TEST(ResourcesTest, ParsesMeminfo) {
  auto memory = parse_meminfo(
      "MemTotal:       263891276 kB\n"
      "MemFree:         1000000 kB\n"
      "MemAvailable:   250000000 kB\n"
      "HugePages_Total:       0\n");
  ASSERT_TRUE(memory.has_value()) << memory.status().to_string();
  EXPECT_EQ(memory->total, 263891276ull * 1024);
  EXPECT_EQ(memory->available, 250000000ull * 1024);

  auto old_kernel = parse_meminfo("MemTotal: 2048 kB\nMemFree: 1024 kB");
  ASSERT_TRUE(old_kernel.has_value());
  EXPECT_EQ(old_kernel->available, 1024u * 1024);

  EXPECT_EQ(parse_meminfo("MemFree: 1 kB\n").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(parse_meminfo("MemTotal: lots kB\n").status().code(), Code::kInvalidArgument);
  EXPECT_EQ(parse_meminfo("MemTotal: 12 MB\n").status().code(), Code::kInvalidArgument);
}

TEST(ResourcesTest, MonitorRefreshesMemoryWithNvmlKeptOpen) {
  ScopedEnv env;
  {
    ResourceMonitor monitor(kFake);
    EXPECT_EQ(fake_live_inits(), 1);
    ASSERT_EQ(monitor.resources().gpus.size(), 2u);
    EXPECT_EQ(monitor.resources().gpus[1].memory_used, 512 * kMiB);
    EXPECT_EQ(link_name(gpu_link(monitor.resources(), 0, 1)), "NV18");

    env.set("TESSERA_FAKE_NVML_USED_MIB", "70000");
    Status status = monitor.refresh();
    EXPECT_TRUE(status.is_ok()) << status.to_string();
    EXPECT_EQ(monitor.resources().gpus[0].memory_used, 70000 * kMiB);
    EXPECT_EQ(monitor.resources().gpus[1].memory_used, 70000 * kMiB);
    EXPECT_GT(monitor.resources().memory_available, 0u);

    env.set("TESSERA_FAKE_NVML_USED_MIB", "100");
    env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetMemoryInfo@1");
    status = monitor.refresh();
    EXPECT_EQ(status.code(), Code::kInternal);
    EXPECT_EQ(status.message(), "GPU1: nvmlDeviceGetMemoryInfo: Unknown Error (NVML error 999)");
    EXPECT_EQ(monitor.resources().gpus[0].memory_used, 100 * kMiB);
    EXPECT_EQ(monitor.resources().gpus[1].memory_used, 70000 * kMiB);  // the previous value
  }
  EXPECT_EQ(fake_live_inits(), 0);
}

TEST(ResourcesTest, SnapshotRefreshesAndReportsRefreshFailures) {
  ScopedEnv env;
  ResourceMonitor monitor(kFake);
  env.set("TESSERA_FAKE_NVML_USED_MIB", "1000");
  NodeResources r = monitor.snapshot();
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_EQ(r.gpus[0].memory_used, 1000 * kMiB);
  EXPECT_EQ(r.gpu_note, "");

  env.set("TESSERA_FAKE_NVML_USED_MIB", "2000");
  env.set("TESSERA_FAKE_NVML_FAIL", "nvmlDeviceGetMemoryInfo@0");
  r = monitor.snapshot();
  EXPECT_EQ(r.gpus[0].memory_used, 1000 * kMiB);
  EXPECT_EQ(r.gpus[1].memory_used, 2000 * kMiB);
  EXPECT_EQ(r.gpu_note, "refresh: GPU0: nvmlDeviceGetMemoryInfo: Unknown Error (NVML error 999)");
  EXPECT_EQ(monitor.resources().gpu_note, "");  // the failure is not kept in the report

  env.unset("TESSERA_FAKE_NVML_FAIL");
  EXPECT_EQ(monitor.snapshot().gpu_note, "");
}

// `tessera start --gpus` / CUDA_VISIBLE_DEVICES: the monitor keeps the GPUs named, by NVML
// index or UUID prefix, in the order found, with their links out of the full matrix, and keeps
// refreshing them; a bad list is refused naming the entry and changes nothing.
TEST(ResourcesTest, KeepsOnlyTheGpusItWasGiven) {
  ScopedEnv env;
  env.set("TESSERA_FAKE_NVML_GPUS", "4");
  const NodeResources full = discover_resources(kFake);
  ASSERT_EQ(full.gpus.size(), 4u);
  ResourceMonitor monitor(kFake);
  const auto refused = [&](const std::string& list, const std::string& says) {
    const Status st = monitor.keep_gpus(list);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << list;
    EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
    EXPECT_EQ(monitor.resources().gpus.size(), 4u) << list << ": changed on a refusal";
  };
  refused("7", "entry '7' names no GPU");
  refused("1,1", "names a GPU the list already has");
  refused("MIG-5e1f0c2a", "neither an NVML index nor a GPU UUID");
  refused("GPU-5e1f", "names several GPUs");
  refused("0,,1", "entry ''");

  ASSERT_TRUE(monitor.keep_gpus(" 3, " + full.gpus[1].uuid).is_ok());
  NodeResources r = monitor.resources();
  ASSERT_EQ(r.gpus.size(), 2u);
  EXPECT_EQ(r.gpus[0].index, 1u);  // the order found, not the list's
  EXPECT_EQ(r.gpus[1].index, 3u);
  EXPECT_EQ(r.gpus[1].uuid, full.gpus[3].uuid);
  ASSERT_EQ(r.links.size(), 4u);
  EXPECT_EQ(gpu_link(r, 0, 0).kind, LinkKind::kSelf);
  EXPECT_EQ(gpu_link(r, 0, 1).kind, gpu_link(full, 1, 3).kind);
  EXPECT_EQ(gpu_link(r, 1, 0).kind, gpu_link(full, 3, 1).kind);
  EXPECT_NE(gpu_link(r, 0, 1).kind, LinkKind::kNvlink);  // 1's NVLink partner is 0, not 3
  env.set("TESSERA_FAKE_NVML_USED_MIB", "3000");
  r = monitor.snapshot();
  EXPECT_EQ(r.gpus[1].memory_used, 3000 * kMiB);
  EXPECT_EQ(r.gpu_note, "");

  // CUDA_VISIBLE_DEVICES as CUDA reads it: the list ends before an entry that names no GPU.
  std::string stopped;
  ASSERT_TRUE(monitor.keep_gpus("3,7,1", &stopped).is_ok());
  ASSERT_EQ(monitor.resources().gpus.size(), 1u);
  EXPECT_EQ(monitor.resources().gpus[0].index, 3u);
  EXPECT_NE(stopped.find("entry '7' names no GPU"), std::string::npos) << stopped;
  ASSERT_TRUE(monitor.keep_gpus("-1", &stopped).is_ok());  // the TensorFlow idiom: no GPU
  EXPECT_TRUE(monitor.resources().gpus.empty());
  EXPECT_NE(stopped.find("entry '-1'"), std::string::npos) << stopped;

  ASSERT_TRUE(monitor.keep_gpus("").is_ok());  // CUDA_VISIBLE_DEVICES="": none
  EXPECT_TRUE(monitor.resources().gpus.empty());
  EXPECT_TRUE(monitor.resources().links.empty());
  EXPECT_TRUE(monitor.refresh().is_ok());
}

TEST(ResourcesTest, MonitorWithoutDriverRefreshesHostOnly) {
  ScopedEnv env;
  ResourceMonitor monitor("/nonexistent/libnvidia-ml.so.1");
  EXPECT_TRUE(monitor.resources().gpus.empty());
  EXPECT_EQ(monitor.resources().gpu_note,
            "no NVIDIA driver: /nonexistent/libnvidia-ml.so.1 not found");
  Status status = monitor.refresh();
  EXPECT_TRUE(status.is_ok()) << status.to_string();
  EXPECT_GT(monitor.resources().memory_total, 0u);
}

}  // namespace
}  // namespace tessera
