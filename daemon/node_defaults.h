// A node daemon's defaults, written once: `tessera start` binds its flags into StartOptions
// (daemon/start.h), which become the DaemonConfig (daemon/daemon.h), the ClusterRegistry's beat
// and the ActorSupervisor's config (daemon/actor_supervisor.h); each starts from these.
#pragma once

#include <cstdint>

namespace tessera::node_defaults {

inline constexpr uint64_t kObjectStoreBytes = uint64_t{2} << 30;  // shared memory: objects, rings
inline constexpr uint32_t kHeartbeatMs = 1000;      // nodes beat this often
inline constexpr uint32_t kMissedBeats = 5;         // a node missing this many in a row is dead
inline constexpr uint32_t kKillGraceMs = 3000;      // an actor's SIGTERM → SIGKILL delay
inline constexpr uint32_t kMaxActors = 128;         // live actors at once
inline constexpr uint32_t kActorHealthTimeoutMs = 10000;  // silent this long: killed as hung
inline constexpr uint32_t kActorStepTimeoutMs = 120000;   // one step this long: stuck

}  // namespace tessera::node_defaults
