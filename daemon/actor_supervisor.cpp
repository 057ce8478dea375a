#include "daemon/actor_supervisor.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>

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
  bool term_sent = false;
};

ActorSupervisor::ActorSupervisor(kj::AsyncIoContext& io, SupervisorConfig config)
    : io_(io), config_(std::move(config)), tasks_(*this) {}

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

}  // namespace

std::vector<std::pair<std::string, std::string>> ActorSupervisor::actor_environment(
    const std::string& id, const ActorSpawnRequest& request) const {
  std::map<std::string, std::string> env;
  for (auto& [name, value] : current_environment()) {
    if (matches_passthrough(name, config_.passthrough)) env[name] = value;
  }
  for (auto& [name, value] : request.env) env[name] = value;
  // The daemon decides which GPUs an actor sees; no job variable overrides that.
  env["CUDA_VISIBLE_DEVICES"] = join_gpus(request.gpus);
  env["TESSERA_ACTOR_ID"] = id;
  env["TESSERA_NODE_ID"] = config_.node_id;
  return {env.begin(), env.end()};
}

kj::Promise<Expected<ActorRecord>> ActorSupervisor::spawn(const std::string& owner,
                                                          const std::string& owner_name,
                                                          const ActorSpawnRequest& request) {
  using Result = Expected<ActorRecord>;
  for (uint32_t gpu : request.gpus) {
    if (gpu >= config_.gpu_count) {
      return Result(invalid_argument("GPU " + std::to_string(gpu) + " requested but node " +
                                     config_.node_id + " has " + std::to_string(config_.gpu_count) +
                                     " GPU(s)"));
    }
  }
  auto binary =
      resolve_binary(request.binary.empty() ? "tessera-actor" : request.binary, config_.bin_dir);
  if (!binary) return Result(binary.status());

  std::string id = random_id("a-");
  ProcessSpec spec;
  spec.binary = *binary;
  spec.args = {"--actor-id", id,
               "--node-id",  config_.node_id,
               "--listen",   config_.listen_host + ":0",
               "--ready-fd", std::to_string(kReadyFd)};
  spec.args.insert(spec.args.end(), request.args.begin(), request.args.end());
  spec.env = actor_environment(id, request);
  spec.log_path = config_.log_dir + "/actor-" + id + ".log";

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
  // Must follow the fork directly, before control returns to the event loop.
  auto exit = io_.unixEventPort.onChildExit(entry->pid);
  live_[id] = std::move(entry);
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
          return Result(unavailable("actor " + id + " died right after it started"));
        }
        it->second->record.address = *address;
        // Say hello like any owner would: proves the actor serves and speaks our protocol.
        return rpc::connect(io_, *address, "node daemon " + config_.node_id, 10 * kj::SECONDS)
            .then([this, id](Expected<kj::Own<rpc::Connection>>&& conn) -> Result {
              auto it = live_.find(id);
              if (it == live_.end()) {
                return Result(unavailable("actor " + id + " died while starting"));
              }
              if (!conn) {
                (void)kill(id, /*force=*/true);
                return Result(conn.status().with_context("actor " + id + " does not answer"));
              }
              it->second->control = kj::mv(*conn);
              it->second->record.state = ActorState::kReady;
              spdlog::info("actor {} ready at {}", id, it->second->record.address);
              return Result(it->second->record);
            });
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

kj::Promise<void> ActorSupervisor::watch_exit(std::string id, kj::Promise<int> exit) {
  return exit.then([this, id](int status) { on_exit(id, status); });
}

void ActorSupervisor::on_exit(const std::string& id, int status) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  ActorRecord record = it->second->record;
  live_.erase(it);
  record.state = ActorState::kDead;
  record.exit_code = wait_exit_code(status);
  record.term_signal = wait_term_signal(status);
  record.death_reason = describe_wait_status(status);
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
