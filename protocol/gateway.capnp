@0xe6183e45382ddd04;
# The bootstrap capability of every Tessera RPC endpoint. A peer must say hello with its protocol
# version before it gets any other capability; a mismatch fails naming both versions.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

using C = import "cluster.capnp";
using N = import "node.capnp";
using A = import "actor.capnp";

const protocolVersion :UInt32 = 1;
# Bump on any incompatible change to these schemas.

enum Role {
  head @0;   # a node daemon that also keeps the cluster registry
  node @1;   # a node daemon
  actor @2;  # an actor process
}

interface Gateway {
  hello @0 (version :UInt32, peer :Text)
      -> (version :UInt32, role :Role, serverId :Text, cluster :C.Cluster, node :N.Node,
          actor :A.Actor);
  # cluster is set by a head, node by any daemon, actor by an actor process.
}
