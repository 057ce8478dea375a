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

  loadModel @2 (spec :S.LoadSpec) -> (info :S.ModelInfo);
  # Loads the checkpoint (its shard, later) and allocates the KV cache. Errors name the tensor
  # and file at fault.

  execute @3 (step :S.StepInput) -> (output :S.StepOutput);
  # Runs one step of the batch and samples where asked.
}
