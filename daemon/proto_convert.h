// Conversions between the daemon's plain C++ records and their Cap'n Proto wire forms.
#pragma once

#include "daemon/actor_supervisor.h"
#include "daemon/resources.h"
#include "protocol/node.capnp.h"

namespace tessera {

void to_proto(const NodeResources& in, proto::NodeResources::Builder out);
void to_proto(const ActorRecord& in, const std::string& node_id, proto::ActorInfo::Builder out);
proto::ActorState to_proto(ActorState state);

}  // namespace tessera
