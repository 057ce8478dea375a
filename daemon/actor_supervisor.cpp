#include "daemon/actor_supervisor.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <random>

#include "common/sha256.h"

#include "daemon/process.h"

namespace tessera {

const char* actor_state_name(ActorState state) {
  switch (state) {
    case ActorState::kStarting:
      return "starting";
    case ActorState::kReady:
      return "ready";
    case ActorState::kDead:
      return "dead";
  }
  return "unknown";
}

std::string random_id(const std::string& prefix, size_t hex_digits) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* kHex = "0123456789abcdef";
  std::string out = prefix;
  for (size_t i = 0; i < hex_digits; ++i) out += kHex[rng() & 15];
  return out;
}

struct ActorSupervisor::Entry {
  ActorRecord record;
  kj::Maybe<pid_t> pid;              // nulled by kj once the child is reaped
  kj::Own<rpc::Connection> control;  // the daemon's own connection to the actor
  std::string key;                   // the actor's RPC secret
  bool term_sent = false;
  kj::Own<kj::AsyncInputStream> beats;  // the actor's heartbeat pipe
  std::array<char, 64> beat_buffer{};
  kj::TimePoint last_beat = kj::origin<kj::TimePoint>();
  kj::Promise<void> beat_task = nullptr;
  uint64_t silent_ms = 0;  // set when the daemon kills it for a stopped heartbeat
};

ActorSupervisor::ActorSupervisor(kj::AsyncIoContext& io, SupervisorConfig config)
    : io_(io), config_(std::move(config)), tasks_(*this) {
  if (config_.health_timeout_ms > 0) tasks_.add(health_loop());
}

ActorSupervisor::~ActorSupervisor() {
  on_death_ = nullptr;  // whoever listened may be gone already
  kill_all_now();
}

void ActorSupervisor::taskFailed(kj::Exception&& exception) {
  spdlog::warn("actor supervisor task failed: {}", exception.getDescription().cStr());
}

void ActorSupervisor::set_death_handler(std::function<void(const ActorRecord&)> handler) {
  on_death_ = std::move(handler);
}

namespace {

bool matches_passthrough(const std::string& name, const std::vector<std::string>& patterns) {
  for (const auto& p : patterns) {
    if (!p.empty() && p.back() == '*') {
      if (name.rfind(p.substr(0, p.size() - 1), 0) == 0) return true;
    } else if (name == p) {
      return true;
    }
  }
  return false;
}

std::string join_gpus(const std::vector<uint32_t>& gpus) {
  std::string out;
  for (size_t i = 0; i < gpus.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(gpus[i]);
  }
  return out;
}

// Variables the daemon sets or keeps to itself: no request may set them.
bool reserved_name(const std::string& name) {
  for (const char* r : {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TESSERA_ACTOR_ID",
                        "TESSERA_NODE_ID", "TESSERA_CLUSTER_TOKEN", "TESSERA_ACTOR_KEY"}) {
    if (name == r) return true;
  }
  return false;
}

// Names that point a program at files or code (a library to load, a plugin, a file to write).
bool names_a_location(const std::string& name) {
  for (const char* word : {"PATH", "FILE", "DIR", "PLUGIN", "LIBRARY", "PRELOAD", "INJECTION"}) {
    if (name.find(word) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

Status check_job_environment(const std::vector<std::pair<std::string, std::string>>& env,
                             const std::vector<std::string>& allow) {
  if (env.size() > 64) {
    return invalid_argument(
        "a spawn request may set at most 64 environment variables, this one "
        "sets " +
        std::to_string(env.size()));
  }
  std::string allowed;
  for (const auto& p : allow) allowed += (allowed.empty() ? "" : ", ") + p;
  for (const auto& [name, value] : env) {
    bool well_formed = !name.empty() && name.size() <= 128 && !(name[0] >= '0' && name[0] <= '9');
    for (char c : name) {
      well_formed = well_formed && ((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_');
    }
    std::string shown = name.substr(0, 64);
    if (!well_formed) {
      return invalid_argument("environment variable name '" + shown +
                              "' is not of the form [A-Z_][A-Z0-9_]*");
    }
    if (reserved_name(name)) {
      return invalid_argument("environment variable " + name +
                              " is set by the daemon itself and may not come from a request");
    }
    if (!matches_passthrough(name, allow)) {
      return invalid_argument("environment variable " + name +
                              " may not be set on an actor: only " + allowed +
                              " are allowed (the daemon's --actor-env-allow adds patterns)");
    }
    if (names_a_location(name)) {
      return invalid_argument("environment variable " + name +
                              " may not be set on an actor: variables that name a path, file, "
                              "directory, library or plugin could make it run other code; set "
                              "it in the daemon's own environment instead");
    }
    if (value.size() > 4096 || value.find('\0') != std::string::npos) {
      return invalid_argument("environment variable " + name +
                              ": its value must be at most 4096 bytes without NUL");
    }
  }
  return Status::ok();
}

namespace {

std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of("\r\n ");
  if (end == std::string::npos) return "";
  size_t start = text.rfind('\n', end);
  std::string line = text.substr(start == std::string::npos ? 0 : start + 1,
                                 end + 1 - (start == std::string::npos ? 0 : start + 1));
  if (line.size() > 400) line = line.substr(0, 400) + "...";
  return line;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ActorSupervisor::actor_environment(
    const std::string& id, const ActorSpawnRequest& request) const {
  std::map<std::string, std::string> env;
  for (auto& [name, value] : current_environment()) {
    if (matches_passthrough(name, config_.passthrough) && !reserved_name(name)) env[name] = value;
  }
  for (auto& [name, value] : request.env) env[name] = value;
  // The daemon decides which GPUs an actor sees; no job variable overrides that.
  env["CUDA_VISIBLE_DEVICES"] = join_gpus(request.gpus);
  env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID";  // CUDA numbers the GPUs as NVML does
  env["TESSERA_ACTOR_ID"] = id;
  env["TESSERA_NODE_ID"] = config_.node_id;
  return {env.begin(), env.end()};
}

kj::Promise<Expected<SpawnedActor>> ActorSupervisor::spawn(const std::string& owner,
                                                           const std::string& owner_name,
                                                           const ActorSpawnRequest& request) {
  using Result = Expected<SpawnedActor>;
  for (uint32_t gpu : request.gpus) {
    if (std::find(config_.gpus.begin(), config_.gpus.end(), gpu) == config_.gpus.end()) {
      std::string offered;
      for (uint32_t g : config_.gpus) offered += (offered.empty() ? "" : ", ") + std::to_string(g);
      return Result(invalid_argument("GPU " + std::to_string(gpu) + " requested but node " +
                                     config_.node_id + " offers " +
                                     (offered.empty() ? "no GPU" : "GPU(s) " + offered)));
    }
  }
  if (live_.size() >= config_.max_actors) {
    return Result(resource_exhausted("node " + config_.node_id + " already runs " +
                                     std::to_string(live_.size()) +
                                     " actors, the most it starts (--max-actors); stop some "
                                     "first"));
  }
  Status env_ok = check_job_environment(request.env, config_.job_env_allow);
  if (!env_ok) return Result(env_ok);
  auto binary = resolve_actor_binary(config_.bin_dir);
  if (!binary) return Result(binary.status());
  auto key = random_bytes(32);
  if (!key) return Result(key.status());

  std::string id = random_id("a-");
  ProcessSpec spec;
  spec.binary = *binary;
  spec.args = {"--actor-id",        id,
               "--node-id",         config_.node_id,
               "--listen",          config_.listen_host + ":0",
               "--ready-fd",        std::to_string(kReadyFd),
               "--key-fd",          std::to_string(kSecretFd),
               "--heartbeat-fd",    std::to_string(kHeartbeatFd),
               "--step-timeout-ms", std::to_string(config_.step_timeout_ms)};
  spec.env = actor_environment(id, request);
  spec.log_path = config_.log_dir + "/actor-" + id + ".log";
  spec.secret = to_hex(*key);

  auto spawned = spawn_process(spec);
  if (!spawned) return Result(spawned.status());

  auto entry = std::make_unique<Entry>();
  entry->record.id = id;
  entry->record.owner = owner;
  entry->record.owner_name = owner_name;
  entry->record.name = request.name;
  entry->record.binary = spec.binary;
  entry->record.log_path = spec.log_path;
  entry->record.gpus = request.gpus;
  entry->record.pid = spawned->pid;
  entry->pid = spawned->pid;
  entry->key = spec.secret;
  entry->beats = io_.lowLevelProvider->wrapInputFd(spawned->heartbeat_fd,
                                                   kj::LowLevelAsyncIoProvider::TAKE_OWNERSHIP);
  entry->last_beat = io_.provider->getTimer().now();
  // Must follow the fork directly, before control returns to the event loop.
  auto exit = io_.unixEventPort.onChildExit(entry->pid);
  live_[id] = std::move(entry);
  live_[id]->beat_task = read_beats(id).eagerlyEvaluate(nullptr);
  tasks_.add(watch_exit(id, kj::mv(exit)));
  spdlog::info("spawned actor {} (pid {}, GPUs [{}]) for {}: {}", id, spawned->pid,
               join_gpus(request.gpus), owner_name, spec.log_path);

  uint32_t timeout_ms = request.ready_timeout_ms ? request.ready_timeout_ms : 30000;
  return wait_ready(id, spawned->ready_fd, timeout_ms)
      .then([this, id](Expected<std::string>&& address) -> kj::Promise<Result> {
        auto it = live_.find(id);
        if (!address) {
          if (it != live_.end()) (void)kill(id, /*force=*/true);
          return Result(address.status());
        }
        if (it == live_.end()) {
          return Result(
              unavailable("actor " + id + " " + death_of(id) + " right after it started"));
        }
        it->second->record.address = *address;
        // Say hello like its owner will: proves the actor serves, speaks our protocol and holds
        // the key it was given.
        return rpc::connect(io_, *address, "node daemon " + config_.node_id, it->second->key,
                            10 * kj::SECONDS)
            .then([this, id](Expected<kj::Own<rpc::Connection>>&& conn) -> kj::Promise<Result> {
              if (!conn && live_.count(id)) {
                // A connection cut by the actor's death arrives before the exit report: give
                // the report a moment, so the error says how it died.
                Status failed = conn.status();
                return io_.provider->getTimer()
                    .afterDelay(1 * kj::SECONDS)
                    .then([this, id, failed]() -> Result {
                      if (live_.count(id)) {
                        (void)kill(id, /*force=*/true);
                        return Result(failed.with_context("actor " + id + " does not answer"));
                      }
                      return Result(
                          unavailable("actor " + id + " " + death_of(id) + " while starting"));
                    });
              }
              auto it = live_.find(id);
              if (it == live_.end()) {
                return Result(unavailable("actor " + id + " " + death_of(id) + " while starting"));
              }
              it->second->control = kj::mv(*conn);
              it->second->record.state = ActorState::kReady;
              it->second->last_beat = io_.provider->getTimer().now();
              spdlog::info("actor {} ready at {}", id, it->second->record.address);
              return Result(SpawnedActor{it->second->record, it->second->key});
            });
      });
}

kj::Promise<void> ActorSupervisor::read_beats(std::string id) {
  auto it = live_.find(id);
  if (it == live_.end()) return kj::READY_NOW;
  Entry& e = *it->second;
  return e.beats->tryRead(e.beat_buffer.data(), 1, e.beat_buffer.size())
      .then([this, id](size_t n) -> kj::Promise<void> {
        auto it = live_.find(id);
        if (n == 0 || it == live_.end()) return kj::READY_NOW;  // EOF: it exited
        it->second->last_beat = io_.provider->getTimer().now();
        return read_beats(id);
      });
}

kj::Promise<void> ActorSupervisor::health_loop() {
  const uint32_t period_ms = std::max<uint32_t>(config_.health_timeout_ms / 4, 20);
  return io_.provider->getTimer().afterDelay(period_ms * kj::MILLISECONDS).then([this]() {
    auto now = io_.provider->getTimer().now();
    for (auto& [id, e] : live_) {
      if (e->record.state != ActorState::kReady || e->silent_ms != 0) continue;
      auto silent = (now - e->last_beat) / kj::MILLISECONDS;
      if (silent < config_.health_timeout_ms) continue;
      e->silent_ms = static_cast<uint64_t>(silent);
      spdlog::warn(
          "actor {} (pid {}, GPUs [{}]) has sent no heartbeat for {} ms (stopped, "
          "or stuck in a step); killing it",
          id, e->record.pid, join_gpus(e->record.gpus), silent);
      KJ_IF_MAYBE (pid, e->pid) {
        ::kill(-*pid, SIGKILL);
        ::kill(*pid, SIGKILL);
      }
    }
    return health_loop();
  });
}

kj::Promise<Expected<std::string>> ActorSupervisor::wait_ready(std::string id, int ready_fd,
                                                               uint32_t timeout_ms) {
  using Result = Expected<std::string>;
  auto stream =
      io_.lowLevelProvider->wrapInputFd(ready_fd, kj::LowLevelAsyncIoProvider::TAKE_OWNERSHIP);
  auto buffer = kj::heap<std::string>();
  auto chunk = kj::heapArray<char>(256);
  // Reads until a newline or EOF (the actor died or closed the pipe without saying READY).
  struct Reader {
    static kj::Promise<void> loop(kj::AsyncInputStream& in, std::string& out,
                                  kj::ArrayPtr<char> buf) {
      return in.tryRead(buf.begin(), 1, buf.size()).then([&in, &out, buf](size_t n) {
        if (n == 0) return kj::Promise<void>(kj::READY_NOW);
        out.append(buf.begin(), n);
        if (out.find('\n') != std::string::npos || out.size() > 4096) {
          return kj::Promise<void>(kj::READY_NOW);
        }
        return loop(in, out, buf);
      });
    }
  };
  auto read = Reader::loop(*stream, *buffer, chunk);
  auto read_with_timeout =
      io_.provider->getTimer().timeoutAfter(timeout_ms * kj::MILLISECONDS, kj::mv(read));
  auto* buf = buffer.get();
  return read_with_timeout
      .then(
          [this, id, buf]() -> kj::Promise<Result> {
            std::string line = buf->substr(0, buf->find('\n'));
            if (line.rfind("READY ", 0) == 0) {
              std::string port = line.substr(6);
              return Result(config_.listen_host + ":" + port);
            }
            // EOF: the actor exited (or closed fd 3) before serving. Give the exit a moment to be
            // reaped so the error can say how it died.
            return io_.provider->getTimer()
                .afterDelay(200 * kj::MILLISECONDS)
                .then([this, id]() -> Result {
                  std::string how = "closed its ready pipe without serving";
                  std::string log;
                  for (const auto& d : dead_) {
                    if (d.id == id) {
                      how = d.death_reason;
                      log = d.log_path;
                    }
                  }
                  auto it = live_.find(id);
                  if (it != live_.end()) log = it->second->record.log_path;
                  std::string tail = tail_file(log, 1500);
                  return unavailable("actor " + id + " " + how + " before serving; log " + log +
                                     (tail.empty() ? std::string(" is empty") : ":\n" + tail));
                });
          },
          [this, id, timeout_ms](kj::Exception&&) -> kj::Promise<Result> {
            std::string log;
            auto it = live_.find(id);
            if (it != live_.end()) log = it->second->record.log_path;
            return Result(deadline_exceeded("actor " + id + " did not serve within " +
                                            std::to_string(timeout_ms) + " ms; log " + log + ":\n" +
                                            tail_file(log, 1500)));
          })
      .attach(kj::mv(stream), kj::mv(buffer), kj::mv(chunk));
}

std::string ActorSupervisor::death_of(const std::string& id) const {
  for (const auto& d : dead_) {
    if (d.id == id) return d.death_reason;
  }
  return "died";
}

kj::Promise<void> ActorSupervisor::watch_exit(std::string id, kj::Promise<int> exit) {
  return exit.then([this, id](int status) { on_exit(id, status); });
}

void ActorSupervisor::on_exit(const std::string& id, int status) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  ActorRecord record = it->second->record;
  const uint64_t silent_ms = it->second->silent_ms;
  live_.erase(it);
  record.state = ActorState::kDead;
  record.exit_code = wait_exit_code(status);
  record.term_signal = wait_term_signal(status);
  record.death_reason = describe_wait_status(status);
  record.last_log_line = last_line(tail_file(record.log_path, 4096));
  if (silent_ms > 0) {
    record.hung = true;
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f", static_cast<double>(silent_ms) / 1000.0);
    record.death_reason = std::string("was killed by its daemon after no heartbeat for ") +
                          seconds + " s (the process was stopped, or stuck in a step)";
  }
  if (record.exit_code == 0 || record.term_signal == SIGTERM) {
    spdlog::info("actor {} (pid {}) {}", id, record.pid, record.death_reason);
  } else {
    spdlog::warn("actor {} (pid {}) {}; its log: {}", id, record.pid, record.death_reason,
                 record.log_path);
  }
  dead_.push_front(record);
  while (dead_.size() > 50) dead_.pop_back();
  if (on_death_) on_death_(record);
}

Status ActorSupervisor::kill(const std::string& id, bool force, const std::string& owner) {
  auto it = live_.find(id);
  if (it == live_.end()) {
    for (const auto& d : dead_) {
      if (d.id == id) return not_found("actor " + id + " is already dead (" + d.death_reason + ")");
    }
    return not_found("no actor " + id + " on node " + config_.node_id);
  }
  Entry& e = *it->second;
  if (!owner.empty() && e.record.owner != owner) {
    return Status(Code::kPermissionDenied,
                  "actor " + id + " belongs to " + e.record.owner_name + ", not this lease");
  }
  KJ_IF_MAYBE (pid, e.pid) {
    int sig = force ? SIGKILL : SIGTERM;
    ::kill(-*pid, sig);  // its process group: the actor and anything it started
    ::kill(*pid, sig);
    e.term_sent = true;
  }
  return Status::ok();
}

void ActorSupervisor::kill_owner(const std::string& owner, const std::string& why) {
  std::vector<std::string> ids;
  for (auto& [id, e] : live_) {
    if (e->record.owner == owner) ids.push_back(id);
  }
  if (ids.empty()) return;
  spdlog::info("stopping {} actor(s) of {}: {}", ids.size(), owner, why);
  for (const auto& id : ids) (void)kill(id, /*force=*/false);
  tasks_.add(io_.provider->getTimer()
                 .afterDelay(config_.kill_grace_ms * kj::MILLISECONDS)
                 .then([this, ids]() {
                   for (const auto& id : ids) {
                     if (live_.count(id)) {
                       spdlog::warn("actor {} ignored SIGTERM for {} ms; sending SIGKILL", id,
                                    config_.kill_grace_ms);
                       (void)kill(id, /*force=*/true);
                     }
                   }
                 }));
}

void ActorSupervisor::kill_all_now() {
  if (live_.empty()) return;
  spdlog::info("killing {} actor(s)", live_.size());
  std::vector<std::string> ids;
  for (auto& [id, e] : live_) ids.push_back(id);
  for (const auto& id : ids) (void)kill(id, /*force=*/true);
  // Reap synchronously (bounded): the event loop may be shutting down.
  for (int round = 0; round < 100 && !live_.empty(); ++round) {
    for (auto it = live_.begin(); it != live_.end();) {
      int status = SIGKILL;  // what we sent; the real status when we reap it ourselves
      bool reaped = false;
      KJ_IF_MAYBE (p, it->second->pid) {
        reaped = ::waitpid(*p, &status, WNOHANG) == *p;
        if (reaped) it->second->pid = nullptr;
      } else {
        reaped = true;  // kj reaped it already; its exit event is still queued
      }
      std::string id = it->first;
      ++it;
      if (reaped) on_exit(id, status);
    }
    if (!live_.empty()) ::usleep(20000);
  }
}

std::vector<ActorRecord> ActorSupervisor::list() const {
  std::vector<ActorRecord> out;
  for (auto& [id, e] : live_) out.push_back(e->record);
  out.insert(out.end(), dead_.begin(), dead_.end());
  return out;
}

std::vector<ActorRecord> ActorSupervisor::list_owner(const std::string& owner) const {
  std::vector<ActorRecord> out;
  for (auto& [id, e] : live_) {
    if (e->record.owner == owner) out.push_back(e->record);
  }
  return out;
}

size_t ActorSupervisor::live_count() const { return live_.size(); }

}  // namespace tessera
