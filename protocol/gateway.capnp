@0xe6183e45382ddd04;
# The bootstrap capability of every Tessera RPC endpoint. Nothing else is handed out before the
# peer has proved it knows the endpoint's secret (the cluster token for daemons, the actor's own
# key for actors) in a challenge-response that never sends the secret:
#
#   client -> hello(version, peer, clientNonce)
#   server <- version check; (role, serverId, serverNonce, serverProof, handshake)
#             serverProof = HMAC(secret, "tessera-server" | role | serverId | clientNonce | serverNonce)
#   client    checks serverProof (the server knows the secret too), then
#   client -> handshake.authenticate(clientProof)
#             clientProof = HMAC(secret, "tessera-client" | peer | serverNonce | clientNonce)
#   server <- the capabilities of its role, or PERMISSION_DENIED and the connection is closed.
# protocol/auth.h computes both proofs; protocol/rpc.cpp runs both sides.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

using C = import "cluster.capnp";
using N = import "node.capnp";
using A = import "actor.capnp";

const protocolVersion :UInt32 = 5;
# Bump on any incompatible change to these schemas. v2: authenticated handshake; v3: sharded
# loading (LoadSpec with the parallel position, prepareComm, initCache) and delta steps; v4: the
# resolved EngineSpec inside LoadSpec; v5: quantized checkpoints (EngineSpec.quantization).

enum Role {
  head @0;   # a node daemon that also keeps the cluster registry
  node @1;   # a node daemon
  actor @2;  # an actor process
}

interface Gateway {
  hello @0 (version :UInt32, peer :Text, clientNonce :Data)
      -> (version :UInt32, role :Role, serverId :Text, serverNonce :Data, serverProof :Data,
          handshake :Handshake);
  # Checks the version (a mismatch fails naming both), then answers the challenge.
}

interface Handshake {
  authenticate @0 (proof :Data) -> (cluster :C.Cluster, node :N.Node, actor :A.Actor);
  # cluster is set by a head, node by any daemon, actor by an actor process. One attempt: a
  # wrong proof fails with PERMISSION_DENIED and the server closes the connection.
}
