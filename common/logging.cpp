#include "common/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <unistd.h>

#include <cstdlib>

namespace tessera {

Status init_logging(const LogOptions& options) {
  std::string level_name = options.level;
  if (level_name.empty()) {
    const char* env = std::getenv("TESSERA_LOG_LEVEL");
    level_name = env != nullptr ? env : "info";
  }
  auto level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    return invalid_argument("unknown log level '" + level_name +
                            "' (use trace, debug, info, warn, error or off)");
  }
  std::shared_ptr<spdlog::logger> logger;
  try {
    if (options.file.empty()) {
      logger = std::make_shared<spdlog::logger>(options.component,
                                                std::make_shared<spdlog::sinks::stderr_sink_mt>());
    } else {
      logger = std::make_shared<spdlog::logger>(
          options.component,
          std::make_shared<spdlog::sinks::basic_file_sink_mt>(options.file, /*truncate=*/false));
    }
  } catch (const spdlog::spdlog_ex& e) {
    return unavailable("cannot open log file " + options.file + ": " + e.what());
  }
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %L %n[" + std::to_string(::getpid()) + "] %v");
  logger->set_level(level);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return Status::ok();
}

}  // namespace tessera
