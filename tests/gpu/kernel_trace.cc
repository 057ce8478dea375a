// A kernel timeline for machines without Nsight Systems: a CUPTI injection library. The CUDA
// driver loads it at cuInit when CUDA_INJECTION64_PATH names it, and it records every kernel's
// start and end (graph nodes included; programmatic dependent launch left as it is) the way
// `nsys stats -r cuda_gpu_trace` lists them, between the program's cudaProfilerStart and
// cudaProfilerStop, into the CSV that KERNEL_TRACE_CSV names:
//
//   export KERNEL_TRACE_CSV=chain.csv CUDA_INJECTION64_PATH=$PWD/tests/libkernel_trace.so
//   MOE_BENCH_PROFILE=1 tests/moe_bench --batch 1
//   scripts/bench/chain_trace.py chain.csv chain-trace.json
//
// Columns: "Start (ns)", "Duration (ns)", "Name" (demangled, quoted), in CUPTI's clock.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Kernel {
  uint64_t start;
  uint64_t end;
  std::string name;
};

struct Trace {
  std::mutex mu;
  std::vector<Kernel> kernels;
  uint64_t from = UINT64_MAX;  // cudaProfilerStart's return, in CUPTI's clock
  bool written = false;
};

Trace& trace() {
  static Trace t;
  return t;
}

void report(const char* what, CUptiResult r) {
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "kernel_trace: %s failed: %s; no trace is written\n", what,
               text != nullptr ? text : "unknown CUPTI error");
}

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kAlign = 8;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlign, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> d(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Trace& t = trace();
  CUpti_Activity* record = nullptr;
  {
    const std::lock_guard<std::mutex> lock(t.mu);
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      t.kernels.push_back({k->start, k->end, demangle(k->name)});
    }
  }
  std::free(buffer);
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

// Writes the kernels that started after cudaProfilerStart returned.
void write_csv() {
  Trace& t = trace();
  const char* env = std::getenv("KERNEL_TRACE_CSV");
  const char* path = env != nullptr ? env : "kernel_trace.csv";
  const std::lock_guard<std::mutex> lock(t.mu);
  if (t.written) return;
  t.written = true;
  std::FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s (KERNEL_TRACE_CSV)\n", path);
    return;
  }
  std::fprintf(f, "Start (ns),Duration (ns),Name\n");
  size_t n = 0;
  for (const Kernel& k : t.kernels) {
    if (k.start < t.from) continue;
    std::fprintf(f, "%llu,%llu,%s\n", static_cast<unsigned long long>(k.start),
                 static_cast<unsigned long long>(k.end - k.start), quoted(k.name).c_str());
    ++n;
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu kernels between cudaProfilerStart and Stop in %s\n", n,
               path);
}

void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_EXIT) return;
  if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) {
    uint64_t now = 0;
    cuptiGetTimestamp(&now);
    const std::lock_guard<std::mutex> lock(trace().mu);
    trace().from = now;
  } else if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000) {
    // The program synchronised before it stopped; hand over every buffer, full or not.
    const CUptiResult r = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (r != CUPTI_SUCCESS) return report("cuptiActivityFlushAll", r);
    write_csv();
  }
}

}  // namespace

// The CUDA driver's entry point for CUDA_INJECTION64_PATH.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (r != CUPTI_SUCCESS) return report("cuptiActivityRegisterCallbacks", r), 0;
  r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (r != CUPTI_SUCCESS) return report("cuptiActivityEnable(CONCURRENT_KERNEL)", r), 0;
  CUpti_SubscriberHandle subscriber{};
  r = cuptiSubscribe(&subscriber, on_api, nullptr);
  if (r != CUPTI_SUCCESS) return report("cuptiSubscribe", r), 0;
  for (CUpti_CallbackId id : {CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000,
                              CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000}) {
    r = cuptiEnableCallback(1, subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, id);
    if (r != CUPTI_SUCCESS) return report("cuptiEnableCallback", r), 0;
  }
  return 1;
}
