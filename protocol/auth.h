// Who may talk to a Tessera endpoint: the secrets and the proofs of the handshake
// (protocol/gateway.capnp describes the exchange; protocol/rpc.cpp runs it).
//
// Two kinds of secret guard the RPC ports:
//  - the cluster token: made by `tessera start --head` (or read from --cluster-token-file), known
//    to every daemon and driver of the cluster; it guards the daemons' ports;
//  - an actor key: made by a daemon for each actor it spawns and handed to the lease that asked
//    for the actor (and nobody else); it guards that actor's port.
// Neither crosses the wire: each side proves it knows the secret with an HMAC-SHA-256 over both
// sides' fresh nonces.
#pragma once

#include <string>

#include "common/status.h"
#include "protocol/gateway.capnp.h"

namespace tessera::auth {

// Bytes of each side's nonce.
inline constexpr size_t kNonceBytes = 32;
// The size rule of a secret (a cluster token, an actor key), wherever one is read or made:
// kMinSecretLength to kMaxSecretLength printable characters. make_secret() makes 64.
inline constexpr size_t kMinSecretLength = 16;
inline constexpr size_t kMaxSecretLength = 1024;
// The environment variable a cluster token may come from.
inline constexpr const char* kTokenEnv = "TESSERA_CLUSTER_TOKEN";

// A fresh secret: 64 hex characters (256 random bits).
Expected<std::string> make_secret();
// A fresh nonce of kNonceBytes raw bytes.
Expected<std::string> make_nonce();

// The proofs of the handshake (raw 32-byte HMACs). `peer` is the name the client gave in hello.
std::string server_proof(const std::string& secret, proto::Role role, const std::string& server_id,
                         const std::string& client_nonce, const std::string& server_nonce);
std::string client_proof(const std::string& secret, const std::string& peer,
                         const std::string& server_nonce, const std::string& client_nonce);

// Checks a secret read from a file or the environment: trimmed of surrounding white space,
// kMinSecretLength to kMaxSecretLength characters, printable ASCII without spaces.
// INVALID_ARGUMENT naming `origin` (where it came from: a path, "$TESSERA_CLUSTER_TOKEN") and
// the rule otherwise; a secret is never cut short.
Expected<std::string> check_secret(std::string text, const std::string& origin);

// Reads a token file: owned by this user, not readable by group or others (like ssh keys), and
// no bigger than a token with some white space around it; then check_secret().
Expected<std::string> read_token_file(const std::string& path);

// Where a command finds the cluster token, in order: `--cluster-token-file PATH` (flag_file),
// $TESSERA_CLUSTER_TOKEN, then the token file a daemon started from this machine's temp root
// wrote (common/session.h). NOT_FOUND, saying how to pass one, when there is none.
Expected<std::string> resolve_cluster_token(const std::string& flag_file, const std::string& root);

}  // namespace tessera::auth
