// `tessera bench router`: the data-parallel router's decision time (router.h), in process, with
// each replica's mirror holding many cached prefixes, as a service under a long-running
// shared-prefix load would: prompts of a random cached prefix and a random tail, timed one
// decision at a time. Prints the percentiles; --output-json writes them with the machine and
// command for bench/results/.
#pragma once

#include <cstdint>
#include <string>

#include "driver/server/router.h"

namespace CLI {
class App;
}

namespace tessera::server {

struct BenchRouterOptions {
  uint32_t replicas = 4;
  uint32_t prefixes = 10000;   // cached per replica
  uint32_t prefix_len = 1024;  // tokens
  uint32_t tail_len = 64;      // tokens after the prefix
  uint32_t decisions = 20000;
  uint32_t block_size = 16;
  RouterPolicy policy = RouterPolicy::kPrefix;
  uint64_t seed = 0;
  std::string output_json;
  std::string command_line;
};

CLI::App* add_bench_router_subcommand(CLI::App& bench, BenchRouterOptions& options);
int bench_router_command(const BenchRouterOptions& options);

}  // namespace tessera::server
