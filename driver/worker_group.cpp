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
// How much earlier than the last step's round trip (less 2% of it) the driver starts polling a
// step's output rings: a futex sleep with a timeout may end up to the timer slack (50 us) late.
constexpr auto kPollLead = std::chrono::microseconds(60);

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

std::string where(const RankInfo& p) {
  return (p.gpu < 0 ? std::string("CPU") : "GPU " + std::to_string(p.gpu)) + " on node " +
         p.node_id;
}

// The collectives' backend: the spec's, kNone for a group of one rank.
CommBackend comm_backend(const WorkerGroupSpec& s) {
  return s.load.parallel.world_size() > 1 ? s.comm_backend : CommBackend::kNone;
}

// NCCL with the custom all-reduce beside it for tensor parallelism.
bool uses_custom_all_reduce(const WorkerGroupSpec& s) {
  return comm_backend(s) == CommBackend::kNccl && s.load.parallel.tp_size > 1 &&
         s.custom_all_reduce_max_bytes > 0;
}

// The ranks of a TP group share CUDA-IPC buffers: the ipc backend, or the custom all-reduce.
bool uses_ipc_buffers(const WorkerGroupSpec& s) {
  return comm_backend(s) == CommBackend::kIpc || uses_custom_all_reduce(s);
}

// How world rank `r`'s actor is spawned: its name, and its GPU first (the one it computes on),
// then, for CUDA IPC, the other GPUs of its TP group on its node: a process opens IPC memory
// only of GPUs it sees.
SpawnOptions spawn_options(const WorkerGroupSpec& s, int r) {
  const ParallelConfig& shape = s.load.parallel;
  const RankInfo& placement = s.placement[static_cast<size_t>(r)];
  SpawnOptions spawn;
  if (placement.gpu >= 0) {
    spawn.gpus = {static_cast<uint32_t>(placement.gpu)};
    const int stage = r / shape.tp_size;
    for (int t = 0; uses_ipc_buffers(s) && t < shape.tp_size; ++t) {
      const RankInfo& peer = s.placement[static_cast<size_t>(stage * shape.tp_size + t)];
      const auto gpu = static_cast<uint32_t>(peer.gpu);
      if (peer.gpu >= 0 && peer.node_id == placement.node_id &&
          std::find(spawn.gpus.begin(), spawn.gpus.end(), gpu) == spawn.gpus.end()) {
        spawn.gpus.push_back(gpu);
      }
    }
  }
  spawn.name = s.owner + (shape.world_size() > 1 ? " rank " + std::to_string(r) : std::string());
  return spawn;
}

// The shared-memory rings' geometry for a model of `load`'s limits: a step ring slot holds the
// largest step (every token, every sequence's block table), an output ring slot the largest
// output (logprobs, and the logits when they are returned); slots enough for every stage in
// flight.
struct RingSizes {
  uint64_t step_slot = 0;
  uint64_t out_slot = 0;
  uint32_t slots = 0;
};
// `load.engine` is resolved (check_resolved ran before): its lengths are set.
RingSizes ring_sizes(const LoadSpec& load) {
  const EngineSpec& e = load.engine;
  const int64_t blocks_per_seq = (e.max_model_len + e.block_size - 1) / e.block_size;
  RingSizes sizes;
  sizes.step_slot =
      (4ull << 20) + e.max_num_batched_tokens * 4 + e.max_num_seqs * (512 + blocks_per_seq * 4);
  sizes.out_slot = (1ull << 20) + e.max_num_seqs * (64 + 24 * kMaxLogprobs) +
                   (e.return_logits ? e.max_num_seqs * 4ull * 262144 : 0);
  sizes.slots = static_cast<uint32_t>(std::max(4, 2 * load.parallel.pp_size + 2));
  return sizes;
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
  // Its world rank, node and GPU as placed; its actor once spawned, its collective endpoint
  // after the rendezvous: what every rank's CommSpec names it by.
  RankInfo info;
  Node* node = nullptr;
  ActorView actor;
  std::unique_ptr<ActorHandle> handle;
  std::string nccl_id;
  std::string ipc_handle;
  std::optional<ShmRing> output_ring;
  std::optional<RingReader> reader;
  // Where its step outputs are copied out of the ring: one slot's size, allocated with the ring
  // (a fresh zeroed megabyte per step was most of an empty step's round trip).
  std::vector<std::byte> out_buffer;
  std::string describe() const {
    return "rank " + std::to_string(info.rank) + " (actor " + actor.actor_id + ", " + where(info) +
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

struct WorkerGroup::Loaded {
  int64_t kv_blocks = 0;               // the fewest KV cache blocks any rank fits
  std::shared_ptr<Progress> progress;  // the weight-loading bar, still open
  uint64_t bytes = 0;                  // the weight bytes the bar last saw (0: none reported)
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
      return "rank " + std::to_string(r->info.rank) + ": ";
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

// Starting a group is a list of phases; each one's comment says what it leaves for the next.
// A phase that fails returns why (with how an actor died, when one did); destroying the
// half-started group ends its leases, which stops its actors and unlinks its rings.
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
  TESSERA_RETURN_IF_ERROR(g->open_leases(cluster));
  TESSERA_RETURN_IF_ERROR(g->spawn_ranks());
  g->start_watching(cluster);
  TESSERA_RETURN_IF_ERROR(g->rendezvous());
  TESSERA_RETURN_IF_ERROR(g->create_rings());
  TESSERA_ASSIGN_OR_RETURN(const Loaded loaded, g->load_weights());
  TESSERA_RETURN_IF_ERROR(g->init_caches(loaded));
  return g;
}

Expected<std::vector<CollectiveCheck>> WorkerGroup::check_collectives(
    EventLoop& loop, ClusterClient& cluster, WorkerGroupSpec spec, uint64_t bytes, int iterations) {
  const int world = spec.load.parallel.world_size();
  if (world < 2) return invalid_argument("a collective check needs at least two ranks");
  if (static_cast<int>(spec.placement.size()) != world) {
    return invalid_argument("the placement has " + std::to_string(spec.placement.size()) +
                            " ranks for " + std::to_string(world));
  }
  std::unique_ptr<WorkerGroup> g(new WorkerGroup(loop, std::move(spec)));
  TESSERA_RETURN_IF_ERROR(g->open_leases(cluster));
  TESSERA_RETURN_IF_ERROR(g->spawn_ranks());
  g->start_watching(cluster);
  TESSERA_RETURN_IF_ERROR(g->rendezvous());
  TESSERA_ASSIGN_OR_RETURN(std::string secret, random_bytes(32));
  using Groups = std::vector<CollectiveCheck>;
  std::vector<kj::Promise<Groups>> calls;
  for (auto& rank : g->ranks_) {
    auto req = rank->handle->capability().commCheckRequest();
    to_proto(g->rank_load_spec(*rank, secret), req.initSpec());
    req.setBytes(bytes);
    req.setIterations(static_cast<uint32_t>(iterations));
    const RankInfo info = rank->info;
    calls.push_back(req.send().then([info](auto&& r) {
      Groups out;
      for (auto c : r.getGroups()) {
        out.push_back({info.rank, info.actor_id, info.node_id, c.getGroup().cStr(),
                       static_cast<int>(c.getRanks()), c.getBytes(),
                       static_cast<int>(c.getIterations()), c.getMedianUs(),
                       c.getBusBandwidthGbps()});
      }
      return out;
    }));
  }
  // The join waits up to the init timeout; the all-reduces of a healthy group take far less.
  const auto limit = (g->spec_.load.engine.nccl_init_timeout_s + 60) * kj::SECONDS;
  auto answers = wait_all(loop, std::move(calls), limit, "collective check");
  Groups out;
  for (size_t r = 0; r < answers.size(); ++r) {
    if (!answers[r]) return g->explain(answers[r].status().with_context(g->ranks_[r]->describe()));
    for (auto& c : *answers[r]) out.push_back(std::move(c));
  }
  return out;
}

// Leases: one per node that the placement names, opened for the spec's owner. Leaves nodes_,
// each with its lease and the world ranks placed on it, in the order the placement first names
// them.
Status WorkerGroup::open_leases(ClusterClient& cluster) {
  std::map<std::string, Node*> by_node;
  for (int r = 0; r < spec_.load.parallel.world_size(); ++r) {
    const std::string& id = spec_.placement[static_cast<size_t>(r)].node_id;
    if (!by_node.count(id)) {
      auto node = std::make_unique<Node>();
      node->node_id = id;
      auto handle =
          id == cluster.head_id() ? Expected<NodeHandle>(cluster.head_node()) : cluster.node(id);
      if (!handle) return handle.status();
      TESSERA_ASSIGN_OR_RETURN(node->lease, handle->open_lease(spec_.owner));
      by_node[id] = node.get();
      nodes_.push_back(std::move(node));
    }
    by_node[id]->ranks.push_back(r);
  }
  return Status::ok();
}

// Spawn: an actor per rank through its node's lease (spawn_options: its GPUs and name), and a
// connection to it. Leaves ranks_ (by world rank, each with its node, actor and handle) and
// actors_.
Status WorkerGroup::spawn_ranks() {
  for (int r = 0; r < spec_.load.parallel.world_size(); ++r) {
    auto rank = std::make_unique<Rank>();
    rank->info = spec_.placement[static_cast<size_t>(r)];
    rank->info.rank = r;
    for (auto& node : nodes_) {
      if (node->node_id == rank->info.node_id) rank->node = node.get();
    }
    auto actor = rank->node->lease->spawn(spawn_options(spec_, r));
    if (!actor) {
      return actor.status().with_context("cannot start rank " + std::to_string(r) + " on " +
                                         where(rank->info));
    }
    rank->actor = *actor;
    rank->info.actor_id = actor->actor_id;
    auto handle = ActorHandle::connect(loop_, actor->address, actor->key);
    actors_.push_back(*actor);
    ranks_.push_back(std::move(rank));
    if (!handle) {
      // An actor that died just now cuts the connection before its death is reported: say how
      // it died when it did.
      return explain(
          handle.status().with_context("cannot connect to " + ranks_.back()->describe()));
    }
    ranks_.back()->handle = std::move(*handle);
  }
  return Status::ok();
}

// Rendezvous (several ranks only): every rank prepares its side of the collectives. Leaves in
// each rank its collective endpoint (info.address), NCCL id and CUDA-IPC buffer handle, as its
// actor answered; load_weights hands everyone's to every rank.
Status WorkerGroup::rendezvous() {
  const CommBackend backend = comm_backend(spec_);
  if (backend == CommBackend::kNone) return Status::ok();
  const int tp_size = spec_.load.parallel.tp_size;
  std::vector<kj::Promise<std::array<std::string, 3>>> calls;
  for (auto& rank : ranks_) {
    auto req = rank->handle->capability().prepareCommRequest();
    req.setBackend(comm_backend_name(backend));
    req.setBufferBytes(uses_ipc_buffers(spec_) ? spec_.ipc_buffer_bytes : 0);
    req.setRank(rank->info.rank % tp_size);  // its place in the TP group the buffers serve
    req.setWorldSize(tp_size);
    calls.push_back(req.send().then([](auto&& r) {
      auto bytes = [](capnp::Data::Reader d) {
        return std::string(reinterpret_cast<const char*>(d.begin()), d.size());
      };
      return std::array<std::string, 3>{std::string(r.getAddress().cStr()), bytes(r.getNcclId()),
                                        bytes(r.getIpcHandle())};
    }));
  }
  auto prepared = wait_all(loop_, std::move(calls), 60 * kj::SECONDS, "prepare collectives");
  for (size_t r = 0; r < prepared.size(); ++r) {
    if (!prepared[r]) {
      return explain(prepared[r].status().with_context(ranks_[r]->describe()));
    }
    ranks_[r]->info.address = (*prepared[r])[0];
    ranks_[r]->nccl_id = (*prepared[r])[1];
    ranks_[r]->ipc_handle = (*prepared[r])[2];
  }
  return Status::ok();
}

// Rings (with use_rings) for the nodes whose shared memory this process can map, this
// machine's: a step ring per node, which this process writes and the node's ranks read, and an
// output ring per rank, which it writes and this process reads. Leaves those nodes `local`
// with their ring and writer, and their ranks with an output ring, reader and buffer; the other
// nodes' ranks take steps over RPC.
Status WorkerGroup::create_rings() {
  TESSERA_RETURN_IF_ERROR(check_resolved(spec_.load.engine));
  const RingSizes sizes = ring_sizes(spec_.load);
  for (auto& node : nodes_) {
    if (!spec_.use_rings) break;
    auto name = node->lease->create_ring("steps", static_cast<uint32_t>(sizes.step_slot),
                                         sizes.slots, static_cast<uint32_t>(node->ranks.size()));
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
      Rank& rank = *ranks_[static_cast<size_t>(r)];
      TESSERA_ASSIGN_OR_RETURN(
          auto out,
          node->lease->create_ring("out-" + std::to_string(r),
                                   static_cast<uint32_t>(sizes.out_slot), sizes.slots, 1));
      TESSERA_ASSIGN_OR_RETURN(auto mapped, ShmRing::open(out));
      rank.output_ring.emplace(std::move(mapped));
      TESSERA_ASSIGN_OR_RETURN(auto reader, rank.output_ring->reader(0));
      rank.reader.emplace(std::move(reader));
      rank.out_buffer.resize(rank.reader->slot_bytes());
    }
  }
  return Status::ok();
}

LoadSpec WorkerGroup::rank_load_spec(const Rank& rank, const std::string& secret) const {
  const ParallelConfig& shape = spec_.load.parallel;
  const CommBackend backend = comm_backend(spec_);
  LoadSpec spec = spec_.load;
  spec.parallel.tp_rank = rank.info.rank % shape.tp_size;
  spec.parallel.pp_rank = rank.info.rank / shape.tp_size;
  spec.comm.backend = backend;
  spec.comm.secret = secret;
  for (auto& other : ranks_) {
    spec.comm.ranks.push_back(other->info);
    if (uses_ipc_buffers(spec_)) spec.comm.ipc_handles.push_back(other->ipc_handle);
  }
  if (backend == CommBackend::kNccl) spec.comm.nccl_id = ranks_.front()->nccl_id;
  if (uses_custom_all_reduce(spec_)) {
    spec.comm.custom_all_reduce_max_bytes =
        std::min(spec_.custom_all_reduce_max_bytes, spec_.ipc_buffer_bytes);
  }
  if (rank.node->local) {
    spec.step_ring = rank.node->step_ring->segment().name();
    auto& on_node = rank.node->ranks;
    spec.step_ring_reader = static_cast<uint32_t>(
        std::find(on_node.begin(), on_node.end(), rank.info.rank) - on_node.begin());
    spec.output_ring = rank.output_ring->segment().name();
  }
  return spec;
}

// Load: every rank at once (their collectives join each other), each with rank_load_spec and a
// secret the group's collectives share; a bar (or lines) shows the weight bytes in place
// meanwhile. Leaves the fewest KV blocks any rank fits, and the bar for init_caches to finish.
Expected<WorkerGroup::Loaded> WorkerGroup::load_weights() {
  std::string secret;
  if (comm_backend(spec_) != CommBackend::kNone) {
    TESSERA_ASSIGN_OR_RETURN(secret, random_bytes(32));
  }
  std::vector<kj::Promise<ModelInfo>> loads;
  for (auto& rank : ranks_) {
    const LoadSpec spec = rank_load_spec(*rank, secret);
    auto req = rank->handle->capability().loadModelRequest();
    to_proto(spec, req.initSpec());
    loads.push_back(req.send().then([](auto&& r) { return from_proto(r.getInfo()); }));
  }
  // The actors load on a thread and answer progress requests meanwhile.
  Loaded out;
  out.progress = std::make_shared<Progress>("loading weights");
  auto seen = std::make_shared<Bytes>(0, 0);
  auto actors = std::make_shared<std::vector<proto::Actor::Client>>();
  actors->reserve(ranks_.size());
  for (auto& rank : ranks_) actors->emplace_back(rank->handle->capability());
  auto poller = show_load_progress(loop_, actors, out.progress, seen).eagerlyEvaluate(nullptr);
  auto loaded = wait_all(loop_, std::move(loads), 30 * 60 * kj::SECONDS, "load model");
  poller = kj::READY_NOW;  // cancels it
  out.bytes = seen->second;
  out.kv_blocks = INT64_MAX;
  for (size_t r = 0; r < loaded.size(); ++r) {
    if (!loaded[r]) return explain(loaded[r].status().with_context(ranks_[r]->describe()));
    out.kv_blocks = std::min(out.kv_blocks, loaded[r]->kv_blocks);
  }
  if (const int64_t cap = spec_.load.engine.num_gpu_blocks_override; cap > 0) {
    if (cap > out.kv_blocks) {
      spdlog::warn("--num-gpu-blocks-override {}: only {} KV blocks fit; using {}", cap,
                   out.kv_blocks, out.kv_blocks);
    } else {
      spdlog::info("--num-gpu-blocks-override: {} KV blocks of the {} that fit", cap,
                   out.kv_blocks);
      out.kv_blocks = cap;
    }
  }
  return out;
}

Expected<ExpertLoad> WorkerGroup::expert_load() {
  std::vector<kj::Promise<ExpertLoad>> calls;
  for (auto& rank : ranks_) {
    calls.push_back(rank->handle->capability().expertLoadRequest().send().then(
        [](auto&& r) { return from_proto(r.getLoad()); }));
  }
  auto loads = wait_all(loop_, std::move(calls), 60 * kj::SECONDS, "read the expert counts");
  ExpertLoad all;
  for (size_t r = 0; r < loads.size(); ++r) {
    if (!loads[r]) return explain(loads[r].status().with_context(ranks_[r]->describe()));
    TESSERA_RETURN_IF_ERROR(all.merge(*loads[r]));
  }
  return all;
}

// Caches: every rank allocates the same KV blocks, the fewest any rank fits. Leaves the group
// ready: model_ (rank 0's view, with those blocks and every rank's weight bytes summed), the
// loading bar finished, sampler_rank_ (the last stage's TP rank 0) and, for several ranks, the
// layout in the log.
Status WorkerGroup::init_caches(const Loaded& loaded) {
  const ParallelConfig& shape = spec_.load.parallel;
  std::vector<kj::Promise<ModelInfo>> inits;
  for (auto& rank : ranks_) {
    auto req = rank->handle->capability().initCacheRequest();
    req.setKvBlocks(loaded.kv_blocks);
    inits.push_back(req.send().then([](auto&& r) { return from_proto(r.getInfo()); }));
  }
  auto ready = wait_all(loop_, std::move(inits), 30 * 60 * kj::SECONDS, "allocate the KV cache");
  for (size_t r = 0; r < ready.size(); ++r) {
    if (!ready[r]) return explain(ready[r].status().with_context(ranks_[r]->describe()));
  }
  model_ = *ready.front();
  model_.kv_blocks = loaded.kv_blocks;
  uint64_t weights = 0;
  for (auto& r : ready) weights += r->weight_bytes;
  model_.weight_bytes = weights;
  const int world = world_size();
  if (loaded.bytes > 0) {
    loaded.progress->finish(loaded.bytes, "on " + std::to_string(world) + " rank(s)");
  }
  sampler_rank_ = (shape.pp_size - 1) * shape.tp_size;  // the last stage's tp rank 0
  if (world > 1) {
    std::string layout;
    for (auto& rank : ranks_) {
      layout += (layout.empty() ? "" : ", ") + std::to_string(rank->info.rank) + ": " +
                where(rank->info) + " layers " +
                std::to_string(ready[static_cast<size_t>(rank->info.rank)]->layer_begin) + "-" +
                std::to_string(ready[static_cast<size_t>(rank->info.rank)]->layer_end - 1);
    }
    spdlog::info("worker group of {} ranks (tp {} x pp {}, {}) ready: {}", world, shape.tp_size,
                 shape.pp_size, comm_backend_name(comm_backend(spec_)), layout);
  }
  return Status::ok();
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
    pending->rpc.emplace(rank->info.rank,
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
  // The output is expected about one round trip (the last step's) after the submission: the
  // rings are polled from a little before then (RingReader::read), not slept on, so a decode
  // step's answer is read at once rather than after a futex wake-up (tens of microseconds).
  const auto expected = std::chrono::microseconds(last_times_.call_us);
  const auto poll_from = last_times_.call_us > 0
                             ? p->submitted + expected - expected / 50 - kPollLead
                             : std::chrono::steady_clock::time_point::min();
  for (auto& rank : ranks_) {
    StepOutput out;
    if (rank->node->local) {
      std::vector<std::byte>& buf = rank->out_buffer;
      while (true) {
        auto n = rank->reader->read(buf, std::chrono::milliseconds(20), poll_from);
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
      auto it = p->rpc.find(rank->info.rank);
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
    if (rank->info.rank == sampler_rank_) {
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
