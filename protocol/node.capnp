@0xadafcf768bd8e52d;
# The node daemon: spawns and watches actors, owns the node's shared memory.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

using Res = import "resources.capnp";
using A = import "actor.capnp";

struct NodeInfo {
  nodeId @0 :Text;            # unique per daemon run ("n-3f2a9c0d1e")
  name @1 :Text;              # --node-name, default the hostname
  address @2 :Text;           # "host:port" the daemon serves RPC on
  isHead @3 :Bool;
  resources @4 :Res.NodeResources;
  startedAtMs @5 :UInt64;     # unix epoch milliseconds
  alive @6 :Bool;             # as the head sees it
  deathReason @7 :Text;       # why the head marked it dead
  lastHeartbeatMs @8 :UInt64; # unix epoch milliseconds of the last beat the head saw
  sessionDir @9 :Text;        # where this daemon writes its logs
  pid @10 :Int32;             # the daemon's PID
  draining @11 :Bool;         # set by `tessera drain`: no new actors go there
}

enum ActorState {
  starting @0;  # spawned, not yet answered hello
  ready @1;     # serving
  dead @2;      # exited; see exitCode / termSignal
}

struct ActorInfo {
  actorId @0 :Text;
  nodeId @1 :Text;
  owner @2 :Text;              # the lease owner's name
  pid @3 :Int32;
  gpus @4 :List(UInt32);       # node GPU indices given to it (CUDA_VISIBLE_DEVICES)
  state @5 :ActorState;
  address @6 :Text;            # "host:port" the actor serves RPC on (direct calls)
  binary @7 :Text;             # absolute path of the executable
  logPath @8 :Text;            # its stdout + stderr
  exitCode @9 :Int32;          # when dead by exit, else -1
  termSignal @10 :Int32;       # when dead by a signal, else 0
  deathReason @11 :Text;       # "exited with code 3", "killed by signal 9 (SIGKILL)", ...
  name @12 :Text;              # the owner's label for it
  lastLogLine @13 :Text;       # when dead: the last line of its log, else empty
  hung @14 :Bool;              # when dead: killed by its daemon after its heartbeat stopped
}

struct EnvVar {
  name @0 :Text;
  value @1 :Text;
}

# What `tessera doctor` asks of a node (driver/doctor.h judges the answers).
struct NodeCheckRequest {
  peers @0 :List(Text);     # "host:port" of the other nodes: each gets a TCP connect
  diskPath @1 :Text;        # where the model would be read from (free space); "" = session dir
  connectTimeoutMs @2 :UInt32;
}

struct PeerReach {
  address @0 :Text;
  reachable @1 :Bool;
  connectMs @2 :Float64;
  error @3 :Text;           # why not, when not reachable
}

# Raw readings; the driver turns them into pass / warn / fail.
struct NodeCheck {
  wallClockMs @0 :UInt64;   # unix epoch milliseconds when the node answered
  shmPath @1 :Text;         # "/dev/shm"
  shmTotal @2 :UInt64;      # bytes (statvfs)
  shmFree @3 :UInt64;
  nofileSoft @4 :UInt64;    # RLIMIT_NOFILE of the daemon (its actors inherit it)
  nofileHard @5 :UInt64;
  diskPath @6 :Text;
  diskFree @7 :UInt64;      # bytes available to an unprivileged user; 0 with diskError set
  diskError @8 :Text;
  ncclEnv @9 :List(EnvVar); # the daemon's NCCL_* variables (its actors inherit them)
  peers @10 :List(PeerReach);
  actorBinary @11 :Text;    # the tessera-actor the daemon spawns
  actorBinaryError @12 :Text;   # why it cannot run, else empty
}

struct SpawnSpec {
  # The executable is always the daemon's own tessera-actor: nothing from the wire names a
  # program, a path or command-line arguments.
  gpus @0 :List(UInt32);       # node GPU indices; empty = a CPU actor (CUDA_VISIBLE_DEVICES="")
  env @1 :List(EnvVar);        # the job's variables: names from the daemon's allow-list only
                               # (NCCL_*, CUDA_*, TESSERA_*, OMP_NUM_THREADS, --actor-env-allow),
                               # never one that names a file, a library or a plugin
  name @2 :Text;               # label shown by `tessera status`
  readyTimeoutMs @3 :UInt32;   # how long the actor may take to serve; 0 = 30 s
}

interface ActorWatcher {
  actorDied @0 (actor :ActorInfo) -> ();
  # Called by the daemon once for each of the lease's actors that dies, however it dies.
}

enum SegmentKind {
  object @0;
  ring @1;
}

struct ShmSegmentInfo {
  name @0 :Text;         # POSIX shm name ("/tessera-s1a2b-obj-weights0")
  kind @1 :SegmentKind;
  id @2 :Text;           # object id or ring name
  bytes @3 :UInt64;
  refs @4 :UInt32;       # objects: readers holding it
  sealed @5 :Bool;       # objects: readable
  owner @6 :Text;        # the lease that created it
}

struct ObjectStoreStats {
  capacity @0 :UInt64;         # the node's shared memory: objects and rings together
  used @1 :UInt64;
  objects @2 :UInt32;          # objects and rings
  leaseCapacity @3 :UInt64;    # the most one lease may hold
}

interface Lease {
  # An owner's hold on a node. Everything made through a lease (actors, ring segments, object
  # references) belongs to it: when the owner disconnects, drops the lease, or lets a lease with
  # a TTL lapse, the daemon kills its actors, unlinks its rings and releases its references.

  spawnActor @0 (spec :SpawnSpec) -> (info :ActorInfo, key :Data);
  # Starts an actor and returns once it serves (state ready) or fails with its log's tail.
  # `key` is the actor's own secret: only a peer that proves it in the actor's handshake (the
  # owner, and the daemon) may call the actor. It is given out here only.

  killActor @1 (actorId :Text, force :Bool) -> ();
  # SIGTERM (or SIGKILL with force); the death is reported to the watcher like any other.
  # PERMISSION_DENIED for another lease's actor.

  renew @2 () -> (ttlMs :UInt32);
  # Keeps a lease with a TTL alive.

  listActors @3 () -> (actors :List(ActorInfo));

  createObject @4 (id :Text, size :UInt64) -> (segment :Text);
  # A new object of `size` bytes in its own shm segment; map it, write it, then seal it.
  # Objects belong to the lease that created them: another lease gets PERMISSION_DENIED from
  # seal/get/release/delete. Hand the segment name to your own actors to share it.
  sealObject @5 (id :Text) -> ();
  getObject @6 (id :Text, timeoutMs :UInt32) -> (segment :Text, size :UInt64);
  # Waits up to timeoutMs for the object to be sealed, then takes a reference for this lease.
  releaseObject @7 (id :Text) -> ();
  deleteObject @8 (id :Text) -> ();
  # Fails while references are held.

  createRing @9 (name :Text, slotBytes :UInt32, slots :UInt32, readers :UInt32)
      -> (segment :Text);
  # A single-writer multi-reader broadcast ring (see common/shm_ring.h). Its bytes count
  # against the node's and the lease's shared-memory capacity like objects do.
}

interface Node {
  info @0 () -> (info :NodeInfo);
  # Identity and fresh resource readings (GPU memory used).

  openLease @1 (owner :Text, ttlMs :UInt32, watcher :ActorWatcher) -> (lease :Lease);
  # ttlMs = 0: the lease lives as long as the owner's connection.

  listActors @2 () -> (actors :List(ActorInfo));
  shmSegments @3 () -> (segments :List(ShmSegmentInfo), stats :ObjectStoreStats);

  shutdown @4 (reason :Text) -> ();
  # Stops this daemon as SIGTERM does (`tessera stop --all`, through the head's stopCluster):
  # it replies, leaves the cluster, kills its actors, unlinks its shared memory and removes its
  # record. Only a peer that proved the cluster token holds a Node capability (protocol/rpc.h:
  # the handshake comes before any capability), so no one without the token can call it.

  doctor @5 (request :NodeCheckRequest) -> (check :NodeCheck);
  # `tessera doctor`'s readings of this node: limits, shared memory, disk, clock, the NCCL
  # variables, and whether the other nodes' daemons accept a TCP connection from here.
}
