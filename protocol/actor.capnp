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

  loadProgress @6 () -> (bytesDone :UInt64, bytesTotal :UInt64);
  # While loadModel runs (on a thread of its own: this answers meanwhile) and after: the weight
  # bytes in place on the device and this rank's total (0 until known, and on the CPU backend,
  # which maps the checkpoint instead of copying it).
}
