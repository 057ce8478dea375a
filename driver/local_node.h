// An embedded local node for commands run without --address: a head daemon started as a child
// process of this one (`tessera start --head --block`, private temp root, any free port). It
// dies with this process (PR_SET_PDEATHSIG) and is stopped when the LocalNode is destroyed.
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

 private:
  LocalNode() = default;
  pid_t pid_ = -1;
  std::string root_;
  std::string address_;
};

}  // namespace tessera
