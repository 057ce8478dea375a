#include "actors/comm/communicator.h"

namespace tessera::comm {

std::string describe_peer(const PeerInfo& peer) {
  std::string who = peer.actor_id;
  if (peer.gpu >= 0) who += (who.empty() ? "GPU " : ", GPU ") + std::to_string(peer.gpu);
  if (!peer.node_id.empty()) who += (who.empty() ? "node " : " on node ") + peer.node_id;
  std::string details = who;
  if (!peer.address.empty()) details += (details.empty() ? "" : ", ") + peer.address;
  std::string out = "rank " + std::to_string(peer.rank);
  if (!details.empty()) out += " (" + details + ")";
  return out;
}

}  // namespace tessera::comm
