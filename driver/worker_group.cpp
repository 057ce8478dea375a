#include "driver/worker_group.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <map>
#include <thread>

#include "common/progress.h"
#include "common/sha256.h"
#include "common/shm_ring.h"
#include "protocol/convert.h"

namespace tessera {

namespace {

// A backstop only: a stuck actor is found by its daemon's watchdog (no progress for
// --actor-step-timeout), a dead one or a dead daemon by its connection; a legal step may be long
// (a 16k-token chunk at a 100k context on the cpu backend takes minutes).
constexpr auto kStepTimeout = std::chrono::hours(1);

// Waits for all `promises`, each turned into an Expected (no early exit, no exception).
template <typename T>
std::vector<Expected<T>> wait_all(EventLoop& loop, std::vector<kj::Promise<T>> promises,
                                  kj::Duration timeout, const char* what) {
  auto results = std::make_shared<std::vector<Expected<T>>>();
  for (size_t i = 0; i < promises.size(); ++i) {
    results->push_back(internal_error(std::string(what) + ": no answer"));
  }
  kj::Vector<kj::Promise<void>> all;
  for (size_t i = 0; i < promises.size(); ++i) {
    all.add(
        promises[i].then([results, i](T&& v) { (*results)[i] = std::move(v); },
                         [results, i](kj::Exception&& e) { (*results)[i] = rpc::to_status(e); }));
  }
  auto joined = kj::joinPromises(all.releaseAsArray());
  auto waited = wait_for(loop, joined.then([]() { return true; }), what, timeout);
  if (!waited) {
    for (auto& r : *results) {
      if (r.status().message().find("no answer") != std::string::npos) r = waited.status();
    }
  }
  return std::move(*results);
}

std::string where(const RankPlacement& p) {
  return (p.gpu < 0 ? std::string("CPU") : "GPU " + std::to_string(p.gpu)) + " on node " +
         p.node_id;
}

// Every half second until cancelled: the weight bytes all `actors` have in place, summed, into
// `seen` and onto `progress`. An actor that does not answer counts as nothing yet.
using Actors = std::shared_ptr<std::vector<proto::Actor::Client>>;
using Bytes = std::pair<uint64_t, uint64_t>;  // done, total
kj::Promise<void> show_load_progress(EventLoop& loop, Actors actors,
                                     std::shared_ptr<Progress> progress,
                                     std::shared_ptr<Bytes> seen) {
  return loop.io().provider->getTimer().afterDelay(500 * kj::MILLISECONDS).then([=, &loop]() {
    kj::Vector<kj::Promise<Bytes>> calls;
    for (auto& actor : *actors) {
      calls.add(actor.loadProgressRequest().send().then(
          [](auto&& r) {
            return Bytes{r.getBytesDone(), r.getBytesTotal()};
          },
          [](kj::Exception&&) {
            return Bytes{0, 0};
          }));
    }
    return kj::joinPromises(calls.releaseAsArray()).then([=, &loop](kj::Array<Bytes> got) {
      *seen = {0, 0};
      for (auto& [done, total] : got) {
        seen->first += done;
        seen->second += total;
      }
      progress->update(seen->first, seen->second);
      return show_load_progress(loop, actors, progress, seen);
    });
  });
}

}  // namespace

struct WorkerGroup::Node {
  std::string node_id;
  std::unique_ptr<LeaseHandle> lease;
  std::vector<int> ranks;  // world ranks placed here
  bool local = false;      // this process maps the node's shared memory: rings
  std::optional<ShmRing> step_ring;
  std::optional<RingWriter> writer;
};

struct WorkerGroup::Rank {
  int rank = 0;
  RankPlacement placement;
  Node* node = nullptr;
  ActorView actor;
  std::unique_ptr<ActorHandle> handle;
  std::string comm_address;
  std::string nccl_id;
  std::string ipc_handle;
  std::optional<ShmRing> output_ring;
  std::optional<RingReader> reader;
  // Where its step outputs are copied out of the ring: one slot's size, allocated with the ring
  // (a fresh zeroed megabyte per step was most of an empty step's round trip).
  std::vector<std::byte> out_buffer;
  std::string describe() const {
    return "rank " + std::to_string(rank) + " (actor " + actor.actor_id + ", " + where(placement) +
           ")";
  }
};

struct WorkerGroup::Pending {
  uint64_t step_id = 0;
  std::chrono::steady_clock::time_point submitted;
  // Replies of the ranks that take steps over RPC, by world rank.
  std::map<int, kj::Promise<StepOutput>> rpc;
};

struct WorkerGroup::Watch {
  kj::Own<kj::PromiseFulfiller<void>> lost;
  kj::ForkedPromise<void> lost_fork{nullptr};  // resolves at the first loss
  std::vector<kj::Promise<void>> connections;
  std::unique_ptr<ClusterClient::Subscription> node_events;
};

WorkerGroup::WorkerGroup(EventLoop& loop, WorkerGroupSpec spec)
    : loop_(loop), spec_(std::move(spec)), watch_(std::make_unique<Watch>()) {
  auto lost = kj::newPromiseAndFulfiller<void>();
  watch_->lost = kj::mv(lost.fulfiller);
  watch_->lost_fork = lost.promise.fork();
}

WorkerGroup::~WorkerGroup() {
  watch_.reset();  // before the connections it watches close
  pending_.clear();
  for (auto& n : nodes_) {
    if (n->writer) n->writer->close();  // the actors' step threads see the end
  }
  ranks_.clear();
  nodes_.clear();  // the leases end: their actors are stopped, their rings unlinked
}

std::string WorkerGroup::rank_prefix(const std::string& actor_id) const {
  for (const auto& r : ranks_) {
    if (r->actor.actor_id == actor_id && ranks_.size() > 1) {
      return "rank " + std::to_string(r->rank) + ": ";
    }
  }
  return {};
}

std::string WorkerGroup::death() const {
  if (const ActorView* dead = first_death()) {
    return rank_prefix(dead->actor_id) + describe_death(*dead, /*with_log=*/false);
  }
  return lost_;
}

void WorkerGroup::lose(std::string why, bool daemon_gone) {
  if (daemon_gone && !lost_.empty() && !daemon_gone_) {
    // An actor's socket went first; its daemon going too says why.
    lost_ += "; " + why;
    daemon_gone_ = true;
    return;
  }
  if (!lost_.empty()) return;
  lost_ = std::move(why);
  daemon_gone_ = daemon_gone;
  if (watch_->lost->isWaiting()) watch_->lost->fulfill();
}

void WorkerGroup::start_watching(ClusterClient& cluster) {
  for (auto& rank : ranks_) {
    Rank* r = rank.get();
    watch_->connections.push_back(r->handle->on_disconnect()
                                      .then([this, r]() {
                                        lose("lost the connection to " + r->describe() +
                                                 " (its process died or its node is unreachable)",
                                             false);
                                      })
                                      .eagerlyEvaluate(nullptr));
  }
  watch_->connections.push_back(
      cluster.on_disconnect()
          .then([this, id = cluster.head_id(), address = cluster.address()]() {
            lose("lost the connection to the head (the daemon of node " + id + " at " + address +
                     "): it is gone (killed or stopped), and the actors it "
                     "started went with it",
                 true);
          })
          .eagerlyEvaluate(nullptr));
  auto events = cluster.subscribe(nullptr, [this](const NodeView& n) {
    for (const auto& node : nodes_) {
      if (node->node_id != n.node_id) continue;
      lose("node " + n.node_id + (n.name.empty() ? "" : " (" + n.name + ")") + " died" +
               (n.death_reason.empty() ? "" : ": " + n.death_reason) +
               "; the actors it started went with it",
           true);
    }
  });
  if (events) {
    watch_->node_events = std::move(*events);
  } else {
    spdlog::warn(
        "cannot follow the cluster's node events ({}); a dead node is still seen through "
        "its actors' connections",
        events.status().message());
  }
}

Status WorkerGroup::failure() {
  // A death report says how the actor died; when its daemon lives it follows the lost socket
  // within milliseconds.
  if (first_death() == nullptr && !daemon_gone_) {
    loop_.run_for(std::chrono::milliseconds(1000),
                  [this]() { return first_death() != nullptr || daemon_gone_; });
  }
  if (!reported_) {
    // Once, in this process's log, with where to read more: statuses carry no paths (they may
    // reach remote clients).
    reported_ = true;
    const ActorView* dead = first_death();
    if (dead != nullptr && !dead->log_path.empty()) {
      const std::string log = spec_.keep_log ? spec_.keep_log(dead->log_path) : dead->log_path;
      spdlog::error("{}; its log: {}", death(), log);
    } else {
      spdlog::error("{}", death());
    }
  }
  return unavailable(death());
}

const ActorView* WorkerGroup::first_death() const {
  for (const auto& n : nodes_) {
    if (n->lease && !n->lease->deaths().empty()) return &n->lease->deaths().front();
  }
  return nullptr;
}

Status WorkerGroup::explain(Status failed) {
  if (failed.is_ok()) return failed;
  // A dropped connection or a stuck collective often arrives before the daemon's death report
  // or the lost socket: give it a moment.
  loop_.run_for(std::chrono::milliseconds(3000), [this]() { return !alive(); });
  if (alive()) return failed;
  return failure();
}

Expected<std::unique_ptr<WorkerGroup>> WorkerGroup::start(EventLoop& loop, ClusterClient& cluster,
                                                          WorkerGroupSpec spec) {
  const ParallelConfig shape = spec.load.parallel;
  const int world = shape.world_size();
  if (static_cast<int>(spec.placement.size()) != world) {
    return invalid_argument("the placement has " + std::to_string(spec.placement.size()) +
                            " ranks for " + std::to_string(shape.tp_size) + " x " +
                            std::to_string(shape.pp_size));
  }
  std::unique_ptr<WorkerGroup> g(new WorkerGroup(loop, std::move(spec)));
  const WorkerGroupSpec& s = g->spec_;
  const std::string backend = world > 1 ? s.comm_backend : "";
  const bool custom_all_reduce =
      backend == "nccl" && shape.tp_size > 1 && s.custom_all_reduce_max_bytes > 0;
  const bool ipc_buffers = backend == "ipc" || custom_all_reduce;
  // Leases: one per node.
  std::map<std::string, Node*> by_node;
  for (int r = 0; r < world; ++r) {
    const std::string& id = s.placement[static_cast<size_t>(r)].node_id;
    if (!by_node.count(id)) {
      auto node = std::make_unique<Node>();
      node->node_id = id;
      auto handle =
          id == cluster.head_id() ? Expected<NodeHandle>(cluster.head_node()) : cluster.node(id);
      if (!handle) return handle.status();
      TESSERA_ASSIGN_OR_RETURN(node->lease, handle->open_lease(s.owner));
      by_node[id] = node.get();
      g->nodes_.push_back(std::move(node));
    }
    by_node[id]->ranks.push_back(r);
  }
  // Actors.
  for (int r = 0; r < world; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->rank = r;
    rank->placement = s.placement[static_cast<size_t>(r)];
    rank->node = by_node[rank->placement.node_id];
    SpawnOptions spawn;
    if (rank->placement.gpu >= 0) {
      // Its own GPU first (the one it computes on), then, for CUDA IPC, the other GPUs of its
      // TP group on this node: a process opens IPC memory only of GPUs it sees.
      spawn.gpus = {static_cast<uint32_t>(rank->placement.gpu)};
      const int stage = r / shape.tp_size;
      for (int t = 0; ipc_buffers && t < shape.tp_size; ++t) {
        const RankPlacement& peer = s.placement[static_cast<size_t>(stage * shape.tp_size + t)];
        const auto gpu = static_cast<uint32_t>(peer.gpu);
        if (peer.gpu >= 0 && peer.node_id == rank->placement.node_id &&
            std::find(spawn.gpus.begin(), spawn.gpus.end(), gpu) == spawn.gpus.end()) {
          spawn.gpus.push_back(gpu);
        }
      }
    }
    spawn.name = s.owner + (world > 1 ? " rank " + std::to_string(r) : std::string());
    auto actor = rank->node->lease->spawn(spawn);
    if (!actor) {
      return actor.status().with_context("cannot start rank " + std::to_string(r) + " on " +
                                         where(rank->placement));
    }
    rank->actor = *actor;
    auto handle = ActorHandle::connect(loop, actor->address, actor->key);
    g->actors_.push_back(*actor);
    g->ranks_.push_back(std::move(rank));
    if (!handle) {
      // An actor that died just now cuts the connection before its death is reported: say how
      // it died when it did.
      return g->explain(
          handle.status().with_context("cannot connect to " + g->ranks_.back()->describe()));
    }
    g->ranks_.back()->handle = std::move(*handle);
  }
  g->start_watching(cluster);
  // Rendezvous: every rank prepares its side of the collectives.
  if (!backend.empty()) {
    std::vector<kj::Promise<std::array<std::string, 3>>> calls;
    for (auto& rank : g->ranks_) {
      auto req = rank->handle->capability().prepareCommRequest();
      req.setBackend(backend);
      req.setBufferBytes(ipc_buffers ? s.ipc_buffer_bytes : 0);
      req.setRank(rank->rank % shape.tp_size);  // its place in the TP group the buffers serve
      req.setWorldSize(shape.tp_size);
      calls.push_back(req.send().then([](auto&& r) {
        auto bytes = [](capnp::Data::Reader d) {
          return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
        };
        return std::array<std::string, 3>{std::string(r.getAddress().cStr()), bytes(r.getNcclId()),
                                          bytes(r.getIpcHandle())};
      }));
    }
    auto prepared = wait_all(loop, std::move(calls), 60 * kj::SECONDS, "prepare collectives");
    for (size_t r = 0; r < prepared.size(); ++r) {
      if (!prepared[r]) {
        return g->explain(prepared[r].status().with_context(g->ranks_[r]->describe()));
      }
      g->ranks_[r]->comm_address = (*prepared[r])[0];
      g->ranks_[r]->nccl_id = (*prepared[r])[1];
      g->ranks_[r]->ipc_handle = (*prepared[r])[2];
    }
  }
  // Rings for the nodes whose shared memory this process can map (this machine's).
  if (s.load.max_model_len <= 0) {
    return invalid_argument("the worker group's max_model_len is not resolved (0)");
  }
  const int64_t max_len = s.load.max_model_len;
  const int64_t blocks_per_seq = (max_len + s.load.block_size - 1) / s.load.block_size;
  const int64_t max_tokens =
      s.load.max_num_batched_tokens > 0 ? s.load.max_num_batched_tokens : 16384;
  const uint64_t step_slot =
      (4ull << 20) + max_tokens * 4 + s.load.max_num_seqs * (512 + blocks_per_seq * 4);
  const uint64_t out_slot = (1ull << 20) + s.load.max_num_seqs * (64 + 24 * kMaxLogprobs) +
                            (s.load.return_logits ? s.load.max_num_seqs * 4ull * 262144 : 0);
  const uint32_t slots = static_cast<uint32_t>(std::max(4, 2 * shape.pp_size + 2));
  for (auto& node : g->nodes_) {
    if (!s.use_rings) break;
    auto name = node->lease->create_ring("steps", static_cast<uint32_t>(step_slot), slots,
                                         static_cast<uint32_t>(node->ranks.size()));
    if (!name) {
      spdlog::warn("no step ring on node {} ({}); its ranks take steps over RPC", node->node_id,
                   name.status().message());
      continue;
    }
    auto ring = ShmRing::open(*name);
    if (!ring) continue;  // another machine's: RPC
    node->step_ring.emplace(std::move(*ring));
    auto writer = node->step_ring->writer();
    if (!writer) return writer.status();
    node->writer.emplace(std::move(*writer));
    node->local = true;
    for (int r : node->ranks) {
      Rank& rank = *g->ranks_[static_cast<size_t>(r)];
      TESSERA_ASSIGN_OR_RETURN(auto out,
                               node->lease->create_ring("out-" + std::to_string(r),
                                                        static_cast<uint32_t>(out_slot), slots, 1));
      TESSERA_ASSIGN_OR_RETURN(auto mapped, ShmRing::open(out));
      rank.output_ring.emplace(std::move(mapped));
      TESSERA_ASSIGN_OR_RETURN(auto reader, rank.output_ring->reader(0));
      rank.reader.emplace(std::move(reader));
      rank.out_buffer.resize(rank.reader->slot_bytes());
    }
  }
  // Load every rank at once (their collectives join each other).
  std::string secret;
  if (!backend.empty()) {
    TESSERA_ASSIGN_OR_RETURN(secret, random_bytes(32));
  }
  std::vector<kj::Promise<ModelInfo>> loads;
  for (auto& rank : g->ranks_) {
    LoadSpec spec = s.load;
    spec.parallel = shape;
    spec.parallel.tp_rank = rank->rank % shape.tp_size;
    spec.parallel.pp_rank = rank->rank / shape.tp_size;
    spec.comm.backend = backend;
    spec.comm.secret = secret;
    for (auto& other : g->ranks_) {
      RankInfo info;
      info.rank = other->rank;
      info.actor_id = other->actor.actor_id;
      info.node_id = other->placement.node_id;
      info.gpu = other->placement.gpu;
      info.address = other->comm_address;
      spec.comm.ranks.push_back(info);
      if (ipc_buffers) spec.comm.ipc_handles.push_back(other->ipc_handle);
    }
    if (backend == "nccl") spec.comm.nccl_id = g->ranks_.front()->nccl_id;
    if (custom_all_reduce) {
      spec.comm.custom_all_reduce_max_bytes =
          std::min(s.custom_all_reduce_max_bytes, s.ipc_buffer_bytes);
    }
    if (rank->node->local) {
      spec.step_ring = rank->node->step_ring->segment().name();
      auto& on_node = rank->node->ranks;
      spec.step_ring_reader = static_cast<uint32_t>(
          std::find(on_node.begin(), on_node.end(), rank->rank) - on_node.begin());
      spec.output_ring = rank->output_ring->segment().name();
    }
    auto req = rank->handle->capability().loadModelRequest();
    to_proto(spec, req.initSpec());
    loads.push_back(req.send().then([](auto&& r) { return from_proto(r.getInfo()); }));
  }
  // A bar (or lines) while the weights load: the actors load on a thread and answer meanwhile.
  auto progress = std::make_shared<Progress>("loading weights");
  auto seen = std::make_shared<Bytes>(0, 0);
  auto actors = std::make_shared<std::vector<proto::Actor::Client>>();
  actors->reserve(g->ranks_.size());
  for (auto& rank : g->ranks_) actors->emplace_back(rank->handle->capability());
  auto poller = show_load_progress(loop, actors, progress, seen).eagerlyEvaluate(nullptr);
  auto loaded = wait_all(loop, std::move(loads), 30 * 60 * kj::SECONDS, "load model");
  poller = kj::READY_NOW;  // cancels it
  int64_t blocks = INT64_MAX;
  for (size_t r = 0; r < loaded.size(); ++r) {
    if (!loaded[r]) return g->explain(loaded[r].status().with_context(g->ranks_[r]->describe()));
    blocks = std::min(blocks, loaded[r]->kv_blocks);
  }
  // Every rank holds the same blocks: the fewest any rank fits.
  std::vector<kj::Promise<ModelInfo>> inits;
  for (auto& rank : g->ranks_) {
    auto req = rank->handle->capability().initCacheRequest();
    req.setKvBlocks(blocks);
    inits.push_back(req.send().then([](auto&& r) { return from_proto(r.getInfo()); }));
  }
  auto ready = wait_all(loop, std::move(inits), 30 * 60 * kj::SECONDS, "allocate the KV cache");
  for (size_t r = 0; r < ready.size(); ++r) {
    if (!ready[r]) return g->explain(ready[r].status().with_context(g->ranks_[r]->describe()));
  }
  g->model_ = *ready.front();
  g->model_.kv_blocks = blocks;
  uint64_t weights = 0;
  for (auto& r : ready) weights += r->weight_bytes;
  g->model_.weight_bytes = weights;
  if (seen->second > 0) {
    progress->finish(seen->second, "on " + std::to_string(world) + " rank(s)");
  }
  g->sampler_rank_ = (shape.pp_size - 1) * shape.tp_size;  // the last stage's tp rank 0
  if (world > 1) {
    std::string layout;
    for (auto& rank : g->ranks_) {
      layout += (layout.empty() ? "" : ", ") + std::to_string(rank->rank) + ": " +
                where(rank->placement) + " layers " +
                std::to_string(ready[static_cast<size_t>(rank->rank)]->layer_begin) + "-" +
                std::to_string(ready[static_cast<size_t>(rank->rank)]->layer_end - 1);
    }
    spdlog::info("worker group of {} ranks (tp {} x pp {}, {}) ready: {}", world, shape.tp_size,
                 shape.pp_size, backend, layout);
  }
  return g;
}

Status WorkerGroup::submit(StepInput step) {
  if (!alive()) return failure();
  auto pending = std::make_unique<Pending>();
  pending->step_id = step.step_id;
  pending->submitted = std::chrono::steady_clock::now();
  bool encoded = false;
  std::vector<std::byte> bytes;
  for (auto& node : nodes_) {
    if (!node->local) continue;
    if (!encoded) {
      bytes = encode(step);
      encoded = true;
    }
    // In slices, so that a group that lost a rank meanwhile fails now (a dead reader never
    // frees its slots).
    const auto give_up = pending->submitted + kStepTimeout;
    Status st = node->writer->write(bytes, std::chrono::milliseconds(20));
    while (st.code() == Code::kDeadlineExceeded && std::chrono::steady_clock::now() < give_up) {
      loop_.wait_scope().poll();
      if (!alive()) return failure();
      st = node->writer->write(bytes, std::chrono::milliseconds(20));
    }
    if (!st) return explain(st.with_context("sending step " + std::to_string(step.step_id)));
  }
  for (auto& rank : ranks_) {
    if (rank->node->local) continue;
    auto req = rank->handle->capability().executeRequest();
    to_proto(step, req.initStep());
    pending->rpc.emplace(rank->rank,
                         req.send().then([](auto&& r) { return from_proto(r.getOutput()); }));
  }
  pending_.push_back(std::move(pending));
  return Status::ok();
}

Expected<int> WorkerGroup::abort(std::chrono::milliseconds within) {
  const auto give_up = std::chrono::steady_clock::now() + within;
  int dropped = 0;
  while (!pending_.empty()) {
    auto out = collect_until(std::min(give_up, pending_.front()->submitted + kStepTimeout));
    if (!out) {
      pending_.clear();
      return out.status();
    }
    ++dropped;
  }
  return dropped;
}

Expected<StepOutput> WorkerGroup::collect() {
  if (pending_.empty()) return failed_precondition("collect() without a submitted step");
  return collect_until(pending_.front()->submitted + kStepTimeout);
}

Expected<StepOutput> WorkerGroup::collect_until(std::chrono::steady_clock::time_point deadline) {
  if (pending_.empty()) return failed_precondition("collect() without a submitted step");
  std::unique_ptr<Pending> p = std::move(pending_.front());
  pending_.erase(pending_.begin());
  auto late = [&](const Rank& rank) {
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(
        std::chrono::steady_clock::now() - p->submitted);
    return deadline_exceeded(rank.describe() + " did not finish step " +
                             std::to_string(p->step_id) + " within " +
                             std::to_string(waited.count()) + " s");
  };
  StepOutput result;
  bool have_result = false;
  for (auto& rank : ranks_) {
    StepOutput out;
    if (rank->node->local) {
      std::vector<std::byte>& buf = rank->out_buffer;
      while (true) {
        auto n = rank->reader->read(buf, std::chrono::milliseconds(20));
        if (n) {
          auto decoded = decode_step_output(std::span<const std::byte>(buf.data(), *n));
          if (!decoded) return decoded.status().with_context(rank->describe());
          out = std::move(*decoded);
          break;
        }
        if (n.status().code() != Code::kDeadlineExceeded) {
          return explain(n.status().with_context(rank->describe()));
        }
        // Meanwhile: death reports from the daemons, lost connections.
        loop_.wait_scope().poll();
        if (!alive()) return failure();
        if (std::chrono::steady_clock::now() > deadline) return late(*rank);
      }
    } else {
      auto it = p->rpc.find(rank->rank);
      // Raced against the group's first loss: a rank that waits on a dead peer's collective
      // would answer only at its own timeout.
      auto raced =
          kj::mv(it->second).exclusiveJoin(watch_->lost_fork.addBranch().then([]() -> StepOutput {
            kj::throwFatalException(KJ_EXCEPTION(DISCONNECTED, "the worker group lost a rank"));
          }));
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      auto got = wait_for(loop_, kj::mv(raced), "execute step",
                          std::max<int64_t>(left.count(), 1) * kj::MILLISECONDS);
      if (!got && !alive()) return failure();
      if (!got && got.status().code() == Code::kDeadlineExceeded) return late(*rank);
      if (!got) return explain(got.status().with_context(rank->describe()));
      out = std::move(*got);
    }
    if (!out.error.empty()) {
      return explain(Status(Code::kInternal, rank->describe() + ": " + out.error));
    }
    if (out.step_id != p->step_id) {
      return internal_error(rank->describe() + " answered step " + std::to_string(out.step_id) +
                            " while step " + std::to_string(p->step_id) + " was expected");
    }
    if (rank->rank == sampler_rank_) {
      result = std::move(out);
      have_result = true;
    }
  }
  if (!have_result) return internal_error("no rank samples in this group");
  last_times_.call_us = static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                  std::chrono::steady_clock::now() - p->submitted)
                                                  .count());
  last_times_.actor_us = result.actor_micros;
  last_times_.gpu_us = result.gpu_micros;
  last_logits_ = std::move(result.logits);
  return result;
}

}  // namespace tessera
