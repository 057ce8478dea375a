// tessera: the command line. Thin: each subcommand parses flags and calls a library.
//
//   tessera start --head [--port 6380] [--block]     start a cluster's head daemon here
//   tessera start --address HEAD:PORT [--block]      join a cluster with this machine
//   tessera status [--address HEAD:PORT] [--json]    nodes, GPUs, links, actors
//   tessera stop                                     stop the daemons started here
//   tessera serve MODEL_DIR [--port 8000] [-tp T]    an OpenAI-compatible HTTP server
//   tessera generate --model DIR --prompt TEXT       one completion, end to end
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
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "common/logging.h"
#include "common/session.h"
#include "daemon/resources.h"
#include "daemon/start.h"
#include "driver/bench.h"
#include "driver/cli/cli_help.h"
#include "driver/generate.h"
#include "driver/make_model/make_model.h"
#include "driver/plan/plan_command.h"
#include "driver/server/bench_serve.h"
#include "driver/server/serve.h"
#include "driver/status.h"
#include "protocol/auth.h"
#include "protocol/rpc.h"

namespace {

int status_command(const std::string& address_flag, const std::string& temp_dir,
                   const std::string& token_file, bool json) {
  auto root = tessera::find_cluster_root(temp_dir);
  std::string address = address_flag;
  if (address.empty()) {
    auto found =
        root ? tessera::read_head_address(*root) : tessera::Expected<std::string>(root.status());
    if (!found) {
      std::cerr << "tessera status: " << found.status().message() << "\n";
      return 1;
    }
    address = *found;
  }
  auto token = tessera::auth::resolve_cluster_token(token_file, root ? *root : std::string());
  if (!token) {
    std::cerr << "tessera status: " << token.status().message() << "\n";
    const char* env = std::getenv("TESSERA_ADDRESS");
    if (address_flag.empty() || env == nullptr || address_flag != env) return 1;
    // The address came from the environment: after `tessera stop` it names a cluster that is
    // gone, the likelier reason than a token missing for a live one.
    std::cerr << "  (the address " << address << " comes from $TESSERA_ADDRESS: if that cluster "
              << "was stopped, unset TESSERA_ADDRESS or start one with `tessera start --head`)\n";
    return 1;
  }
  tessera::EventLoop loop;
  auto status = tessera::collect_status(loop, address, *token);
  if (!status) {
    std::cerr << "tessera status: " << status.status().message() << "\n";
    return 1;
  }
  std::cout << (json ? tessera::render_status_json(*status) : tessera::render_status(*status));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera: distributed LLM inference runtime"};
  app.require_subcommand(1);
  // Flags of `tessera` itself (--log-level, --version, --help) are taken before or after the
  // subcommand, as users type both; subcommands created below inherit this.
  app.fallthrough();
  app.set_version_flag("--version", std::string("tessera ") + TESSERA_VERSION + " (protocol v" +
                                        std::to_string(tessera::rpc::kProtocolVersion) + ")");
  std::string log_level;
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error")
      ->envname("TESSERA_LOG_LEVEL");

  tessera::StartOptions start;
  auto* start_cmd = app.add_subcommand("start", "Start a node daemon on this machine");
  start_cmd->add_flag("--head", start.head, "Start a new cluster with this node as its head");
  start_cmd->add_option("--address", start.address, "Join the cluster whose head is HOST:PORT");
  start_cmd->add_option("--port", start.port, "RPC port (head default 6380, members any free)")
      ->check(CLI::Range(0, 65535));
  start_cmd->add_flag("--block", start.block, "Stay in the foreground and log to stderr");
  start_cmd->add_option("--temp-dir", start.temp_dir,
                        "Root for session logs and records (default $TESSERA_TMPDIR or "
                        "/tmp/tessera)");
  start_cmd->add_option("--cluster-token-file", start.cluster_token_file,
                        "The cluster token (head: instead of a new one; members: the head's)");
  start_cmd->add_option("--node-ip,--host", start.node_ip,
                        "Address to listen on and advertise (default: loopback for a head, the "
                        "address that reaches the head for a member)");
  start_cmd->add_option("--node-name", start.node_name, "Name shown in status (default hostname)");
  start_cmd->add_option("--bind", start.bind_host,
                        "Listen here instead of --node-ip (e.g. 0.0.0.0), still advertising "
                        "--node-ip");
  start_cmd
      ->add_option("--object-store-memory", start.object_store_memory,
                   "Bytes of shared memory for objects and rings (default 2 GiB)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 50));
  start_cmd->add_option("--shm-per-lease", start.shm_per_lease,
                        "Bytes of shared memory one lease may hold (default: all of it)");
  start_cmd
      ->add_option("--max-connections", start.max_connections,
                   "RPC connections open at once (default 512)")
      ->check(CLI::Range(1u, 1000000u));
  start_cmd
      ->add_option("--max-message-mib", start.max_message_mib,
                   "Largest RPC message a peer may send, MiB (default 64)")
      ->check(CLI::Range(1u, 4096u));
  start_cmd->add_option("--max-actors", start.max_actors, "Actors alive at once (default 128)")
      ->check(CLI::Range(1u, 100000u));
  start_cmd
      ->add_option("--actor-health-timeout", start.actor_health_timeout_s,
                   "Seconds without a heartbeat before an actor is killed as hung (default "
                   "10; 0 = off)")
      ->check(CLI::Range(0.0, 86400.0));
  start_cmd
      ->add_option("--actor-step-timeout", start.actor_step_timeout_s,
                   "Seconds a step may go without progress before the actor counts as "
                   "stuck (default 120; 0 = off)")
      ->check(CLI::Range(0.0, 86400.0));
  start_cmd->add_option("--actor-env-allow", start.actor_env_allow,
                        "More environment variables a driver may set on actors (NAME or "
                        "PREFIX_*; repeatable)");
  start_cmd->add_flag("--ephemeral", start.ephemeral)->group("");  // embedded local nodes
  start_cmd->add_option("--heartbeat-ms", start.heartbeat_ms, "Heartbeat period (default 1000)")
      ->check(CLI::Range(10u, 600000u));
  start_cmd
      ->add_option("--missed-heartbeats", start.missed_beats,
                   "Missed beats before a node is dead (default 5)")
      ->check(CLI::Range(1u, 1000u));
  start_cmd->add_option("--nvml-library", start.nvml_library,
                        "Path of libnvidia-ml.so.1 (default: the system's)");
  start_cmd->add_option("--actor-bin-dir", start.bin_dir,
                        "Where tessera-actor lives (default: next to tessera)");

  tessera::StopOptions stop;
  auto* stop_cmd = app.add_subcommand("stop", "Stop the daemons started on this machine");
  stop_cmd->add_option("--temp-dir", stop.temp_dir, "The root they were started with");
  stop_cmd->add_option("--timeout", stop.timeout_s, "Seconds before SIGKILL (default 10)");

  std::string status_address, status_temp, status_token;
  bool status_json = false;
  auto* status_cmd = app.add_subcommand("status", "Show the cluster: nodes, GPUs, actors");
  status_cmd
      ->add_option("--address", status_address,
                   "Head HOST:PORT (default: $TESSERA_ADDRESS, else this machine's cluster)")
      ->envname("TESSERA_ADDRESS");
  status_cmd->add_option("--temp-dir", status_temp, "The root the head was started with");
  status_cmd->add_option("--cluster-token-file", status_token,
                         "The cluster token (default: $TESSERA_CLUSTER_TOKEN or this machine's)");
  status_cmd->add_flag("--json", status_json, "Print JSON");

  tessera::GenerateOptions gen;
  std::vector<int32_t> stop_ids;
  std::optional<uint64_t> gen_seed;
  gen.sampling.max_tokens = 64;
  auto* gen_cmd = app.add_subcommand("generate", "Generate completions for one or more prompts");
  tessera::add_engine_options(gen_cmd, gen.engine);
  gen_cmd->add_option("--prompt", gen.prompts, "The prompt text (repeat for a batch)");
  gen_cmd->add_option("--input", gen.input,
                      "A JSONL file of {\"prompt\": ...} or {\"prompt_token_ids\": [...]}");
  gen_cmd->add_option("--output", gen.output, "Write the results as JSONL here");
  gen_cmd->add_option("--max-tokens", gen.sampling.max_tokens, "Tokens to generate (64)");
  gen_cmd->add_option("--temperature", gen.sampling.temperature, "0 = greedy (default 1.0)");
  gen_cmd->add_option("--top-p", gen.sampling.top_p, "Nucleus sampling mass (1.0 = off)");
  gen_cmd->add_option("--top-k", gen.sampling.top_k, "Keep the k most likely (-1 = off)");
  gen_cmd->add_option("--min-p", gen.sampling.min_p, "Drop tokens below min_p x the top (0 = off)");
  gen_cmd->add_option("--seed", gen_seed,
                      "The run's random seed: every prompt's sampler (default: unseeded)");
  gen_cmd->add_option("--repetition-penalty", gen.sampling.repetition_penalty, "(1.0 = off)");
  gen_cmd->add_option("--presence-penalty", gen.sampling.presence_penalty, "(0 = off)");
  gen_cmd->add_option("--frequency-penalty", gen.sampling.frequency_penalty, "(0 = off)");
  gen_cmd->add_option("--stop", gen.sampling.stop, "Stop strings (repeatable)");
  gen_cmd->add_option("--stop-token-ids", stop_ids, "Token ids that end generation");
  gen_cmd->add_flag("--ignore-eos", gen.sampling.ignore_eos, "Keep going past EOS");
  gen_cmd->add_option("--logprobs", gen.sampling.logprobs, "Return top-N logprobs per token");
  gen_cmd->add_flag("--json", gen.json, "Print ids, text and logprobs as JSON, a line per prompt");

  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  tessera::BenchLatencyOptions latency;
  auto* latency_cmd = bench_cmd->add_subcommand(
      "latency", "End-to-end latency of one batch, over many iterations (vLLM's)");
  tessera::add_engine_options(latency_cmd, latency.engine);
  latency_cmd->add_option("--input-len", latency.input_len, "Random prompt tokens (32)");
  latency_cmd->add_option("--output-len", latency.output_len,
                          "Tokens each request generates, EOS ignored (128)");
  latency_cmd->add_option("--batch-size", latency.batch_size, "Requests in the batch (8)");
  latency_cmd->add_option("--num-iters-warmup", latency.num_iters_warmup,
                          "Unmeasured iterations first (10)");
  latency_cmd->add_option("--num-iters", latency.num_iters, "Measured iterations (30)");
  latency_cmd->add_option("--seed", latency.seed,
                          "The run's random seed: prompts and samplers (0)");
  tessera::add_bench_output_options(latency_cmd, latency.output_json, latency.json);

  tessera::BenchReportOptions bench;
  auto* report_cmd = bench_cmd->add_subcommand(
      "report",
      "Tessera's report: batch-1 decode (TTFT, step breakdown), a long prefill and a large-batch "
      "decode of one model");
  tessera::add_engine_options(report_cmd, bench.engine);
  report_cmd->add_option("--input-len", bench.input_len, "Prompt tokens (128)");
  report_cmd->add_option("--output-len", bench.output_len, "New tokens (256)");
  report_cmd->add_option("--num-iters", bench.num_iters, "Measured batch-1 runs (3)");
  report_cmd->add_option("--num-iters-warmup", bench.num_iters_warmup, "Warm-up runs (1)");
  report_cmd->add_option("--prefill-len", bench.prefill_len,
                         "Long prefill tokens (4096; 0 = skip)");
  report_cmd->add_option("--prefill-iters", bench.prefill_iters, "Measured prefills (5)");
  report_cmd->add_option("--batch-size", bench.batch_size,
                         "Large-batch decode size (64; 0 = skip)");
  report_cmd->add_option("--batch-iters", bench.batch_iters, "Measured large-batch runs (2)");
  report_cmd->add_option("--seed", bench.seed, "The run's random seed: the prompts (0)");
  tessera::add_bench_output_options(report_cmd, bench.output_json, bench.json);

  tessera::BenchThroughputOptions throughput;
  auto* throughput_cmd = bench_cmd->add_subcommand(
      "throughput", "Offline throughput: many requests at once through one engine (vLLM's)");
  tessera::add_engine_options(throughput_cmd, throughput.engine);
  throughput_cmd->add_option("--num-prompts", throughput.num_prompts, "Requests (1000)");
  throughput_cmd->add_option("--input-len", throughput.input_len, "Random prompt tokens (1024)");
  throughput_cmd->add_option("--output-len", throughput.output_len,
                             "Tokens each request generates, EOS ignored (128)");
  throughput_cmd->add_option("--dataset-path", throughput.dataset_path,
                             "JSONL of prompts: \"prompt\" or \"prompt_token_ids\", optional "
                             "\"output_len\" (default: random prompts)");
  throughput_cmd->add_option(
      "--seed", throughput.seed,
      "The run's random seed: prompts, and request i's sampler (seed + i) (0)");
  tessera::add_bench_output_options(throughput_cmd, throughput.output_json, throughput.json);

  tessera::BenchControlPlaneOptions control;
  auto* control_cmd = bench_cmd->add_subcommand(
      "control-plane", "Round trip of empty steps driver -> ranks -> driver (rings or RPC)");
  tessera::add_engine_options(control_cmd, control.engine);
  control_cmd
      ->add_option("--transport", control.transport,
                   "ring: shared-memory step rings; rpc: an execute RPC per step (ring)")
      ->check(CLI::IsMember({"ring", "rpc"}));
  control_cmd->add_option("--num-steps", control.num_steps, "Measured steps (10000)");
  control_cmd->add_option("--num-warmup", control.num_warmup, "Unmeasured steps first (200)");
  tessera::add_bench_output_options(control_cmd, control.output_json, control.json);

  tessera::server::BenchServeOptions bench_serve;
  auto* bench_serve_cmd = tessera::server::add_bench_serve_subcommand(*bench_cmd, bench_serve);

  tessera::MakeModelOptions make;
  auto* make_cmd = tessera::add_make_model_subcommand(app, make);

  tessera::TopoOptions topo_opts;
  auto* topo_cmd = tessera::add_topo_subcommand(app, topo_opts);
  tessera::PlanOptions plan_opts;
  plan_opts.describe_this_machine = [] { return tessera::discover_resources(); };
  auto* plan_cmd = tessera::add_plan_subcommand(app, plan_opts);

  tessera::server::ServeOptions serve;
  auto* serve_cmd = tessera::server::add_serve_subcommand(app, serve);

  auto* version_cmd = app.add_subcommand("version", "Print the version and protocol version");

  using tessera::add_examples;
  add_examples(start_cmd, {"tessera start --head",
                           "tessera start --address 10.0.0.1:6380 "
                           "--cluster-token-file ./cluster_token"});
  add_examples(stop_cmd, {"tessera stop"});
  add_examples(status_cmd, {"tessera status", "tessera status --address 10.0.0.1:6380 --json"});
  add_examples(gen_cmd, {"tessera generate --model ./Llama-3.1-8B-Instruct --prompt \"Hello\" "
                         "--max-tokens 32 --temperature 0"});
  add_examples(bench_cmd, {"tessera bench throughput --model ./llama3-8b --num-prompts 1000"});
  add_examples(latency_cmd, {"tessera bench latency --model ./llama3-8b --batch-size 8 "
                             "--input-len 32 --output-len 128"});
  add_examples(report_cmd, {"tessera bench report --model ./llama3-8b --output-json report.json"});
  add_examples(control_cmd,
               {"tessera bench control-plane --model ./tiny -tp 2 --device cpu --transport ring"});
  add_examples(throughput_cmd, {"tessera bench throughput --model ./llama3-8b --num-prompts 1000 "
                                "--input-len 1000 --output-len 1000"});
  add_examples(bench_serve_cmd, {"tessera bench serve --base-url http://127.0.0.1:8000 "
                                 "--num-prompts 200 --max-concurrency 32"});
  add_examples(make_cmd, {"tessera make-model --preset llama3-8b --tokenizer ./llama3-tokenizer "
                          "--out ./llama3-8b"});
  add_examples(topo_cmd, {"tessera topo", "tessera topo --json > cluster.json"});
  add_examples(plan_cmd, {"tessera plan --model ./llama3-70b -tp auto",
                          "tessera plan --model ./llama3-70b --gpus 8 -tp 4 -pp 2"});
  add_examples(serve_cmd, {"tessera serve ./Llama-3.1-8B-Instruct --port 8000 -tp 2"});
  add_examples(version_cmd, {"tessera version", "tessera --version"});

  // vLLM's spellings CLI11 cannot define: `serve MODEL`, -tp / -pp.
  std::vector<std::string> raw(argv, argv + argc);
  raw = tessera::server::serve_positional_model(std::move(raw));
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

  if (*start_cmd) {
    start.log_level = log_level;
    return tessera::start_command(start);
  }
  // A server reports its requests (info); other commands stay quiet unless asked.
  const std::string level = !log_level.empty() ? log_level : (*serve_cmd ? "info" : "warn");
  if (auto st = tessera::init_logging({"cli", "", level}); !st) {
    std::cerr << "tessera: " << st.message() << "\n";
    return 2;
  }
  // The command as typed, recorded in the benches' JSON.
  std::string command_line;
  for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
  if (*stop_cmd) return tessera::stop_command(stop);
  if (*serve_cmd) return tessera::server::serve_command(serve);
  if (*gen_cmd) {
    gen.sampling.seed = gen_seed;
    gen.sampling.stop_token_ids = stop_ids;
    return tessera::generate_command(gen);
  }
  if (*latency_cmd) {
    latency.command_line = command_line;
    return tessera::bench_latency_command(latency);
  }
  if (*control_cmd) {
    control.command_line = command_line;
    return tessera::bench_control_plane_command(control);
  }
  if (*report_cmd) {
    bench.command_line = command_line;
    return tessera::bench_report_command(bench);
  }
  if (*bench_serve_cmd) {
    bench_serve.command_line = command_line;
    return tessera::server::bench_serve_command(bench_serve);
  }
  if (*throughput_cmd) {
    throughput.command_line = command_line;
    return tessera::bench_throughput_command(throughput);
  }
  if (*make_cmd) {
    tessera::Status st = tessera::make_model(make);
    if (!st) {
      std::cerr << "tessera make-model: " << st.message() << "\n";
      return 1;
    }
    std::cout << "Wrote " << make.out << "\n";
    return 0;
  }
  if (*status_cmd) {
    return status_command(status_address, status_temp, status_token, status_json);
  }
  if (*topo_cmd) return tessera::topo_command(topo_opts);
  if (*plan_cmd) return tessera::plan_command(plan_opts);
  if (*version_cmd) {
    std::cout << "tessera " << TESSERA_VERSION << " (protocol v" << tessera::rpc::kProtocolVersion
              << ")\n";
    return 0;
  }
  return 2;
}
