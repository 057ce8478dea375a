// An embedded local node for commands run without --address: a head daemon started as a child
// process of this one (`tessera start --head --block --ephemeral`, loopback only, any free
// port) in a private folder <temp root>/local-XXXXXX, with a cluster token of its own. It dies
// with this process (PR_SET_PDEATHSIG; on its way out it removes its folder) and is stopped
// when the LocalNode is destroyed. A folder left by a SIGKILLed pair is removed by the next
// start on this machine (common/session.h, cleanup_stale).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace tessera {

class LocalNode {
 public:
  // Starts the daemon and waits (bounded) until it serves. `tessera_binary` is the `tessera`
  // executable ("" = this process's own executable).
  static Expected<std::unique_ptr<LocalNode>> start(const std::string& tessera_binary = "");
  ~LocalNode();
  LocalNode(const LocalNode&) = delete;
  LocalNode& operator=(const LocalNode&) = delete;

  const std::string& address() const { return address_; }
  const std::string& root() const { return root_; }
  // The local cluster's token (drivers connect with it).
  const std::string& token() const { return token_; }

 private:
  LocalNode() = default;
  pid_t pid_ = -1;
  std::string root_;
  std::string address_;
  std::string token_;
};

}  // namespace tessera
