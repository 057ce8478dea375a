@0xf702ddf64399aa4c;
# Cluster membership, kept by the head daemon.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

using N = import "node.capnp";

struct NodeUsage {
  memoryAvailable @0 :UInt64;
  gpuMemoryUsed @1 :List(UInt64);  # per GPU, bytes
  actors @2 :UInt32;               # live actors
}

interface NodeSession {
  # A registered node's membership; dropping it (disconnecting) marks the node dead.
  heartbeat @0 (usage :NodeUsage) -> ();
  # Fails once the head has marked the node dead: the node must register again.
  leave @1 (reason :Text) -> ();
}

interface ClusterListener {
  nodeAdded @0 (node :N.NodeInfo) -> ();
  nodeDead @1 (node :N.NodeInfo) -> ();
}

interface Subscription {}
# Dropping it stops the events.

struct NodeEntry {
  info @0 :N.NodeInfo;
  node @1 :N.Node;  # calls on it go through the head to the node's daemon
}

interface Cluster {
  registerNode @0 (info :N.NodeInfo, node :N.Node, nodeSecret :Data)
      -> (nodeId :Text, session :NodeSession, heartbeatMs :UInt32, missedBeats :UInt32);
  # nodeSecret is made by the node daemon when it starts: registering an id again needs the same
  # secret, so no other connection can take a node's id over. Registering again while the old
  # session still stands (a member whose heartbeat timed out and reconnected) replaces it
  # without declaring the node dead.
  listNodes @1 (includeDead :Bool) -> (nodes :List(NodeEntry));
  subscribe @2 (listener :ClusterListener) -> (subscription :Subscription);
  drainNode @3 (node :Text, undo :Bool) -> (node :N.NodeInfo);
  # `tessera drain`: marks a live node draining (undo: clears the mark) and returns it as listed.
  # `node` is a node id or a node name (as `tessera status` prints them); no live node of that
  # id or name: NOT_FOUND naming it and listing the live nodes. While a node drains, placement
  # puts no new ranks there, and the Node capabilities the head hands out (listNodes, and the
  # head's own from the handshake) refuse openLease, and spawnActor on their leases, with
  # FAILED_PRECONDITION; its running actors are left alone.
  stopCluster @4 (reason :Text) -> (stopped :List(N.NodeInfo));
  # `tessera stop --all`: the head calls shutdown on every live member, waits (a few seconds at
  # most) for them to leave, replies with the nodes that took the request (itself last), then
  # stops itself as SIGTERM would. A member that cannot be reached is left out of `stopped`.
  # Like every call here it needs the cluster token: the handshake comes first.
}
