#include "daemon/proto_convert.h"

namespace tessera {

namespace {

proto::LinkKind to_proto(LinkKind kind) {
  switch (kind) {
    case LinkKind::kSelf:
      return proto::LinkKind::SELF;
    case LinkKind::kNvlink:
      return proto::LinkKind::NVLINK;
    case LinkKind::kPix:
      return proto::LinkKind::PIX;
    case LinkKind::kPxb:
      return proto::LinkKind::PXB;
    case LinkKind::kPhb:
      return proto::LinkKind::PHB;
    case LinkKind::kNode:
      return proto::LinkKind::NODE;
    case LinkKind::kSys:
      return proto::LinkKind::SYS;
    case LinkKind::kUnknown:
      return proto::LinkKind::UNKNOWN;
  }
  return proto::LinkKind::UNKNOWN;
}

}  // namespace

void to_proto(const NodeResources& in, proto::NodeResources::Builder out) {
  out.setHostname(in.hostname);
  out.setCpus(in.cpus);
  out.setMemoryTotal(in.memory_total);
  out.setMemoryAvailable(in.memory_available);
  auto gpus = out.initGpus(static_cast<unsigned>(in.gpus.size()));
  for (size_t i = 0; i < in.gpus.size(); ++i) {
    const auto& g = in.gpus[i];
    auto b = gpus[static_cast<unsigned>(i)];
    b.setIndex(g.index);
    b.setName(g.name);
    b.setUuid(g.uuid);
    b.setPciBusId(g.pci_bus_id);
    b.setMemoryTotal(g.memory_total);
    b.setMemoryUsed(g.memory_used);
  }
  auto links = out.initLinks(static_cast<unsigned>(in.links.size()));
  for (size_t i = 0; i < in.links.size(); ++i) {
    links[static_cast<unsigned>(i)].setKind(to_proto(in.links[i].kind));
    links[static_cast<unsigned>(i)].setNvlinks(in.links[i].nvlinks);
  }
  out.setDriverVersion(in.driver_version);
  out.setCudaVersion(in.cuda_version);
  out.setGpuNote(in.gpu_note);
}

proto::ActorState to_proto(ActorState state) {
  switch (state) {
    case ActorState::kStarting:
      return proto::ActorState::STARTING;
    case ActorState::kReady:
      return proto::ActorState::READY;
    case ActorState::kDead:
      return proto::ActorState::DEAD;
  }
  return proto::ActorState::DEAD;
}

void to_proto(const ActorRecord& in, const std::string& node_id, proto::ActorInfo::Builder out) {
  out.setActorId(in.id);
  out.setNodeId(node_id);
  out.setOwner(in.owner_name);
  out.setPid(in.pid);
  auto gpus = out.initGpus(static_cast<unsigned>(in.gpus.size()));
  for (size_t i = 0; i < in.gpus.size(); ++i) gpus.set(static_cast<unsigned>(i), in.gpus[i]);
  out.setState(to_proto(in.state));
  out.setAddress(in.address);
  out.setBinary(in.binary);
  out.setLogPath(in.log_path);
  out.setExitCode(in.exit_code);
  out.setTermSignal(in.term_signal);
  out.setDeathReason(in.death_reason);
  out.setName(in.name);
  out.setLastLogLine(in.last_log_line);
  out.setHung(in.hung);
}

}  // namespace tessera
