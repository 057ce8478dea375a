@0xb790eb7d886cfe7e;
# The actor process: one per GPU (or a CPU worker). Later issues add load and execute.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

using Res = import "resources.capnp";
using S = import "step.capnp";

struct ActorHealth {
  actorId @0 :Text;
  pid @1 :Int32;
  uptimeMs @2 :UInt64;
  backend @3 :Text;                # "cuda" or "cpu"
  visibleDevices @4 :Text;         # CUDA_VISIBLE_DEVICES as the actor sees it
  devices @5 :List(Res.GpuInfo);   # what the CUDA runtime sees (indices are CUDA ordinals)
  ncclVersion @6 :Text;            # "2.28.9", empty on the CPU backend
  note @7 :Text;                   # why backend is "cpu" when GPUs were asked for, else empty
}

struct CommGroupCheck {
  group @0 :Text;               # "tensor-parallel" or "pipeline"
  ranks @1 :UInt32;
  bytes @2 :UInt64;             # per all-reduce
  iterations @3 :UInt32;
  medianUs @4 :Float64;         # one all-reduce, as this rank timed it
  busBandwidthGbps @5 :Float64; # nccl-tests' bus bandwidth
}

struct P2pCopy {
  src @0 :UInt32;               # CUDA ordinals in the actor
  dst @1 :UInt32;
  peerAccess @2 :Bool;          # cudaDeviceCanAccessPeer
  ok @3 :Bool;                  # the bytes arrived intact
  gbps @4 :Float64;
  error @5 :Text;
}

interface Actor {
  health @0 () -> (health :ActorHealth);
  # Cheap liveness and identity check.

  shutdown @1 () -> ();
  # Exits the process cleanly after replying.

  prepareComm @2 (backend :Text, bufferBytes :UInt64, rank :Int32, worldSize :Int32)
      -> (address :Text, ncclId :Data, ipcHandle :Data);
  # Before loading a multi-rank model: "tcp" opens this actor's collective endpoint and returns
  # its address; "nccl" makes an ncclUniqueId (the driver takes rank 0's and hands it to all);
  # "ipc", and "nccl" with bufferBytes > 0 (the custom all-reduce beside NCCL), allocate this
  # rank's CUDA-IPC buffers of bufferBytes and return their handle. rank and worldSize are the
  # rank's place in the group the IPC buffers serve: its tensor-parallel group.

  loadModel @3 (spec :S.LoadSpec) -> (info :S.ModelInfo);
  # Joins the collective groups the spec names (bounded by its init timeout, naming the rank
  # that did not join), loads this rank's shard of the checkpoint and sizes the KV cache:
  # info.kvBlocks is how many blocks fit. Errors name the tensor and file at fault.

  initCache @4 (kvBlocks :Int64) -> (info :S.ModelInfo);
  # Allocates the KV cache with kvBlocks (the fewest any rank fits), captures the CUDA graphs
  # (every rank at once), and starts reading steps from the step ring when the spec named one.

  execute @5 (step :S.StepInput) -> (output :S.StepOutput);
  # Runs one step (actors without a step ring).

  expertLoad @7 () -> (load :S.ExpertLoad);
  # The routings this rank counted in its mixture-of-experts layers since it loaded (empty for a
  # dense model, and for the ranks that leave the counting to another): the driver adds the
  # ranks' up for the bench's expert balance.

  commCheck @8 (spec :S.LoadSpec, bytes :UInt64, iterations :UInt32)
      -> (groups :List(CommGroupCheck));
  # `tessera doctor`: after prepareComm, instead of loadModel. Joins the groups the spec names
  # (bounded by its init timeout, naming the rank that did not join) and all-reduces a known
  # pattern of `bytes` through each group of several ranks, checking every sum on every rank.
  # The actor's collectives are used up: a model needs a fresh actor.

  p2pCheck @9 (bytes :UInt64) -> (copies :List(P2pCopy));
  # `tessera doctor`, in an actor given several GPUs: every ordered pair's advertised peer
  # access, then `bytes` copied GPU to GPU, timed and read back. FAILED_PRECONDITION with fewer
  # than two GPUs or without CUDA.

  loadProgress @6 () -> (bytesDone :UInt64, bytesTotal :UInt64);
  # While loadModel runs (on a thread of its own: this answers meanwhile) and after: the weight
  # bytes in place on the device and this rank's total (0 until known, and on the CPU backend,
  # which maps the checkpoint instead of copying it).
}
