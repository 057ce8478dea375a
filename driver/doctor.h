// `tessera doctor`: the tutorials' pre-flight folklore as a command. It asks every node's daemon
// for its readings (NodeHandle::check: limits, /dev/shm, disk, clock, NCCL variables, TCP reach
// to the other nodes), reads the GPUs and link matrix the head lists, plans the ranks (with
// --model, their memory too), and runs a real all-reduce across them (WorkerGroup::
// check_collectives), then prints one line per finding: pass / warn / fail, each with its fix.
// Exit status 1 when anything fails; --json gives the same findings as data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/engine_spec.h"

namespace CLI {
class App;
}

namespace tessera {

enum class Verdict { kPass, kWarn, kFail };
const char* verdict_name(Verdict v);  // "pass", "warn", "fail"

struct Finding {
  std::string node;   // the node's label, or "cluster"
  std::string check;  // "shm", "nofile", "clock", "reach", "gpus", "links", "allreduce", ...
  Verdict verdict = Verdict::kPass;
  std::string detail;  // what was measured
  std::string fix;     // what to do, when not a pass
};

// The thresholds, in one place.
namespace doctor_limits {
inline constexpr uint64_t kShmFail = 256ull << 20;  // Docker's default 64 MiB is far below
inline constexpr uint64_t kShmWarn = 1ull << 30;
inline constexpr uint64_t kNofileFail = 1024;
inline constexpr uint64_t kNofileWarn = 65536;
inline constexpr uint64_t kDiskFail = 1ull << 30;
inline constexpr uint64_t kDiskWarn = 10ull << 30;
inline constexpr int64_t kSkewWarnMs = 500;
inline constexpr int64_t kSkewFailMs = 2000;
}  // namespace doctor_limits

struct DoctorOptions {
  std::string address;
  std::string temp_dir;
  std::string cluster_token_file;
  EngineSpec engine;  // --model, -tp, -pp, ... (with --model: the plan's memory per GPU)
  bool json = false;
  uint32_t node_timeout_s = 10;         // a node that does not answer within this fails
  uint64_t allreduce_bytes = 4u << 20;  // per all-reduce of the collective check
  int allreduce_iterations = 5;
  uint32_t join_timeout_s = 30;  // every rank joins the collective check within this
};

CLI::App* add_doctor_subcommand(CLI::App& app, DoctorOptions& options);
int doctor_command(const DoctorOptions& options);

}  // namespace tessera
