// tessera: the command line. Thin: each subcommand registers its flags next to its code (an
// add_*_subcommand beside its *_command) and runs in a library; main wires them up, parses and
// dispatches.
//
//   tessera start --head [--port 6380] [--block]     start a cluster's head daemon here
//   tessera start --address HEAD:PORT [--block]      join a cluster with this machine
//   tessera status [--address HEAD:PORT] [--json]    nodes, GPUs, links, actors
//   tessera drain NODE [--undo] [--wait [SECONDS]]   no new actors on NODE; wait for it to empty
//   tessera stop [--all]                             stop the daemons started here (--all:
//                                                    every node of the cluster)
//   tessera doctor [--model DIR -tp T -pp P] [--json]  pre-flight checks of every node, fixes
//   tessera serve MODEL_DIR [--port 8000] [-tp T]    an OpenAI-compatible HTTP server
//   tessera generate MODEL_DIR --prompt TEXT         one completion, end to end
//   tessera make-model --arch A --preset P ...       a seeded random checkpoint of real shape
//   tessera topo [--address HEAD:PORT] [--json]      GPU links per node, TP sizes on NVLink
//   tessera plan --model DIR -tp T -pp P ...         TP x PP split, placement, memory per GPU
//   tessera bench latency|throughput|serve|report|control-plane ...   benchmarks (--json)
//   tessera --version | version                       the version and protocol version
//
// --log-level, --version and --help go before or after the subcommand. A mistyped flag or
// subcommand gets the nearest valid name (driver/cli/cli_help.h); every --help ends with an
// example. --address defaults to $TESSERA_ADDRESS; status/stop/topo find this machine's cluster.
//
// Exit codes (decided here only): 0 success, 1 the operation failed, 2 bad usage.
#include <CLI/CLI.hpp>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "common/logging.h"
#include "daemon/resources.h"
#include "daemon/start.h"
#include "driver/bench.h"
#include "driver/cli/cli_help.h"
#include "driver/doctor.h"
#include "driver/drain.h"
#include "driver/generate.h"
#include "driver/make_model/make_model.h"
#include "driver/plan/plan_command.h"
#include "driver/server/bench_router.h"
#include "driver/server/bench_serve.h"
#include "driver/server/serve.h"
#include "driver/status.h"
#include "protocol/rpc.h"

namespace {

std::string version_text() {
  return std::string("tessera ") + TESSERA_VERSION + " (protocol v" +
         std::to_string(tessera::rpc::kProtocolVersion) + ")";
}

// Every subcommand's options, bound to its flags by its add_*_subcommand, and the subcommand as
// registered (true once parsed).
struct Commands {
  tessera::StartOptions start;
  tessera::StopOptions stop;
  tessera::StatusOptions status;
  tessera::DoctorOptions doctor;
  tessera::DrainOptions drain;
  tessera::GenerateOptions generate;
  tessera::BenchLatencyOptions latency;
  tessera::BenchReportOptions report;
  tessera::BenchThroughputOptions throughput;
  tessera::BenchControlPlaneOptions control_plane;
  tessera::server::BenchServeOptions bench_serve;
  tessera::server::BenchRouterOptions bench_router;
  tessera::MakeModelOptions make_model;
  tessera::TopoOptions topo;
  tessera::PlanOptions plan;
  tessera::server::ServeOptions serve;

  CLI::App* start_cmd = nullptr;
  CLI::App* stop_cmd = nullptr;
  CLI::App* status_cmd = nullptr;
  CLI::App* doctor_cmd = nullptr;
  CLI::App* drain_cmd = nullptr;
  CLI::App* generate_cmd = nullptr;
  CLI::App* latency_cmd = nullptr;
  CLI::App* report_cmd = nullptr;
  CLI::App* throughput_cmd = nullptr;
  CLI::App* control_plane_cmd = nullptr;
  CLI::App* bench_serve_cmd = nullptr;
  CLI::App* bench_router_cmd = nullptr;
  CLI::App* make_model_cmd = nullptr;
  CLI::App* topo_cmd = nullptr;
  CLI::App* plan_cmd = nullptr;
  CLI::App* serve_cmd = nullptr;
  CLI::App* version_cmd = nullptr;
};

// Adds every subcommand to `app`, in the order --help lists them.
void add_subcommands(CLI::App& app, Commands& c) {
  using tessera::add_examples;
  c.start_cmd = tessera::add_start_subcommand(app, c.start);
  c.stop_cmd = tessera::add_stop_subcommand(app, c.stop);
  c.status_cmd = tessera::add_status_subcommand(app, c.status);
  c.doctor_cmd = tessera::add_doctor_subcommand(app, c.doctor);
  c.drain_cmd = tessera::add_drain_subcommand(app, c.drain);
  c.generate_cmd = tessera::add_generate_subcommand(app, c.generate);
  CLI::App* bench = tessera::add_bench_subcommand(app);
  c.latency_cmd = tessera::add_bench_latency_subcommand(*bench, c.latency);
  c.report_cmd = tessera::add_bench_report_subcommand(*bench, c.report);
  c.throughput_cmd = tessera::add_bench_throughput_subcommand(*bench, c.throughput);
  c.control_plane_cmd = tessera::add_bench_control_plane_subcommand(*bench, c.control_plane);
  c.bench_serve_cmd = tessera::server::add_bench_serve_subcommand(*bench, c.bench_serve);
  c.bench_router_cmd = tessera::server::add_bench_router_subcommand(*bench, c.bench_router);
  c.make_model_cmd = tessera::add_make_model_subcommand(app, c.make_model);
  c.topo_cmd = tessera::add_topo_subcommand(app, c.topo);
  add_examples(c.topo_cmd, {"tessera topo", "tessera topo --json > cluster.json"});
  c.plan.describe_this_machine = [] { return tessera::discover_resources(); };
  c.plan_cmd = tessera::add_plan_subcommand(app, c.plan);
  add_examples(c.plan_cmd, {"tessera plan --model ./llama3-70b -tp auto",
                            "tessera plan --model ./llama3-70b --gpus 8 -tp 4 -pp 2"});
  c.serve_cmd = tessera::server::add_serve_subcommand(app, c.serve);
  add_examples(c.serve_cmd, {"tessera serve ./Llama-3.1-8B-Instruct --port 8000 -tp 2"});
  c.version_cmd = app.add_subcommand("version", "Print the version and protocol version");
  add_examples(c.version_cmd, {"tessera version", "tessera --version"});
}

// Parses argv into `app`, vLLM's spellings CLI11 cannot define (`serve MODEL`, for every model
// command; -tp / -pp) rewritten first. nullopt when a subcommand is to run, else the exit code:
// 0 after --help or --version, 2 for bad usage (after the nearest valid names).
std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  std::vector<std::string> raw(argv, argv + argc);
  raw = tessera::positional_model_argv(std::move(raw));
  std::vector<const char*> raw_ptrs;
  for (const auto& a : raw) raw_ptrs.push_back(a.c_str());
  tessera::ParallelFlagArgv args(static_cast<int>(raw_ptrs.size()), raw_ptrs.data());
  try {
    app.parse(args.argc(), args.argv());
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    if (rc != 0) std::cerr << tessera::unknown_argument_hints(app);
    return rc == 0 ? 0 : 2;
  }
  return std::nullopt;
}

// Runs the subcommand that was parsed, any but `start` (which runs before logging is set up);
// returns its exit code. `command_line` is recorded in the benches' JSON.
int run_command(Commands& c, const std::string& command_line) {
  if (*c.stop_cmd) return tessera::stop_command(c.stop);
  if (*c.serve_cmd) return tessera::server::serve_command(c.serve);
  if (*c.generate_cmd) return tessera::generate_command(c.generate);
  if (*c.latency_cmd) {
    c.latency.command_line = command_line;
    return tessera::bench_latency_command(c.latency);
  }
  if (*c.control_plane_cmd) {
    c.control_plane.command_line = command_line;
    return tessera::bench_control_plane_command(c.control_plane);
  }
  if (*c.report_cmd) {
    c.report.command_line = command_line;
    return tessera::bench_report_command(c.report);
  }
  if (*c.bench_router_cmd) {
    c.bench_router.command_line = command_line;
    return tessera::server::bench_router_command(c.bench_router);
  }
  if (*c.bench_serve_cmd) {
    c.bench_serve.command_line = command_line;
    return tessera::server::bench_serve_command(c.bench_serve);
  }
  if (*c.throughput_cmd) {
    c.throughput.command_line = command_line;
    return tessera::bench_throughput_command(c.throughput);
  }
  if (*c.make_model_cmd) return tessera::make_model_command(c.make_model);
  if (*c.status_cmd) return tessera::status_command(c.status);
  if (*c.doctor_cmd) return tessera::doctor_command(c.doctor);
  if (*c.drain_cmd) return tessera::drain_command(c.drain);
  if (*c.topo_cmd) return tessera::topo_command(c.topo);
  if (*c.plan_cmd) return tessera::plan_command(c.plan);
  if (*c.version_cmd) {
    std::cout << version_text() << "\n";
    return 0;
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera: distributed LLM inference runtime"};
  app.require_subcommand(1);
  // Flags of `tessera` itself (--log-level, --version, --help) are taken before or after the
  // subcommand, as users type both; subcommands created below inherit this.
  app.fallthrough();
  app.set_version_flag("--version", version_text());
  std::string log_level;
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error")
      ->envname("TESSERA_LOG_LEVEL");
  Commands commands;
  add_subcommands(app, commands);
  if (std::optional<int> rc = parse(app, argc, argv)) return *rc;

  if (*commands.start_cmd) {
    commands.start.log_level = log_level;
    return tessera::start_command(commands.start);
  }
  // A server reports its requests (info); other commands stay quiet unless asked.
  const std::string level =
      !log_level.empty() ? log_level : (*commands.serve_cmd ? "info" : "warn");
  if (auto st = tessera::init_logging({"cli", "", level}); !st) {
    std::cerr << "tessera: " << st.message() << "\n";
    return 2;
  }
  // Once logging is set up, so that --log-level decides whether it shows.
  if (std::string note = tessera::trust_remote_code_note(app); !note.empty()) {
    spdlog::info("{}", note);
  }
  // The command as typed, recorded in the benches' JSON.
  std::string command_line;
  for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
  return run_command(commands, command_line);
}
