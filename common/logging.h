// Logging set-up shared by every Tessera process: spdlog, one line per event.
//
// Each process calls init_logging once in main. Lines look like
//   2026-11-30 03:41:07.123 I daemon[1234] registered node n-3f2a (2 GPUs) from 10.0.0.2:41022
// Levels: trace, debug, info, warn, error. The level comes from the argument, else from
// TESSERA_LOG_LEVEL, else info.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

#include "common/status.h"

namespace tessera {

struct LogOptions {
  std::string component;  // "daemon", "actor", "driver", "cli", ...
  std::string file;       // append to this file; empty = stderr
  std::string level;      // empty = $TESSERA_LOG_LEVEL or "info"
};

// Installs the default logger. Fails only if the log file cannot be opened or the level is
// not a known name.
Status init_logging(const LogOptions& options);

}  // namespace tessera
