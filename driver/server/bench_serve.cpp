#include "driver/server/bench_serve.h"

#include <unistd.h>
#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <semaphore>
#include <thread>

#include "common/status.h"
#include "driver/bench.h"
#include "driver/cli/cli_help.h"

namespace tessera::server {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Url {
  std::string host, port, prefix;  // prefix: a path the endpoints go under ("" for none)
};

Expected<Url> parse_url(const std::string& base) {
  const std::string scheme = "http://";
  if (base.rfind(scheme, 0) != 0) {
    return invalid_argument("--base-url " + base + ": only http:// URLs are supported");
  }
  std::string rest = base.substr(scheme.size());
  Url u;
  if (size_t slash = rest.find('/'); slash != std::string::npos) {
    u.prefix = rest.substr(slash);
    rest.resize(slash);
    while (!u.prefix.empty() && u.prefix.back() == '/') u.prefix.pop_back();
  }
  if (size_t colon = rest.rfind(':'); colon != std::string::npos) {
    u.host = rest.substr(0, colon);
    u.port = rest.substr(colon + 1);
  } else {
    u.host = rest;
    u.port = "80";
  }
  if (u.host.empty() || u.port.empty() ||
      !std::all_of(u.port.begin(), u.port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return invalid_argument("--base-url " + base + ": expected http://HOST:PORT");
  }
  return u;
}

// One HTTP/1.1 call on its own connection. `on_body` sees the body received so far after each
// read (a streamed answer arrives piece by piece). The status code, or an error naming the step.
Expected<int> http_call(const Url& u, http::verb verb, const std::string& path,
                        const std::string& body, const std::string& key,
                        const std::function<void(const std::string&)>& on_body,
                        std::string* whole = nullptr) {
  asio::io_context io;
  tcp::resolver resolver(io);
  beast::tcp_stream stream(io);
  beast::error_code ec;
  auto where = [&](const char* step) {
    return unavailable(std::string(step) + " http://" + u.host + ":" + u.port + u.prefix + path +
                       ": " + ec.message());
  };
  auto endpoints = resolver.resolve(u.host, u.port, ec);
  if (ec) return where("resolving");
  stream.expires_after(std::chrono::seconds(30));
  stream.connect(endpoints, ec);
  if (ec) return where("connecting to");
  http::request<http::string_body> req{verb, u.prefix + path, 11};
  req.set(http::field::host, u.host + ":" + u.port);
  req.set(http::field::user_agent, "tessera-bench");
  if (!key.empty()) req.set(http::field::authorization, "Bearer " + key);
  if (!body.empty()) {
    req.set(http::field::content_type, "application/json");
    req.body() = body;
  }
  req.prepare_payload();
  stream.expires_after(std::chrono::hours(1));
  http::write(stream, req, ec);
  if (ec) return where("sending to");
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  http::read_header(stream, buffer, parser, ec);
  if (ec) return where("reading the answer of");
  if (on_body && !parser.get().body().empty()) on_body(parser.get().body());
  while (!parser.is_done()) {
    const size_t before = parser.get().body().size();
    http::read_some(stream, buffer, parser, ec);
    if (ec == http::error::end_of_stream) break;
    if (ec) return where("reading the answer of");
    if (on_body && parser.get().body().size() != before) on_body(parser.get().body());
  }
  if (whole) *whole = parser.get().body();
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
  return static_cast<int>(parser.get().result_int());
}

struct RequestResult {
  bool ok = false;
  std::string error;
  double ttft = 0, e2el = 0;  // seconds
  std::vector<double> itl;
  size_t prompt_tokens = 0, output_tokens = 0;
};

// One streamed completion: its timings from the SSE events as they arrive.
RequestResult run_request(const Url& u, const BenchServeOptions& o, const std::string& model,
                          const std::string& key, const BenchPrompt& p) {
  json body = {{"model", model},
               {"max_tokens", p.output_len},
               {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (p.ids.empty()) {
    body["prompt"] = p.text;
  } else {
    body["prompt"] = p.ids;
  }
  if (o.ignore_eos) body["ignore_eos"] = true;
  if (o.temperature) body["temperature"] = *o.temperature;
  RequestResult r;
  size_t scanned = 0, events = 0;
  bool done = false;
  const auto start = Clock::now();
  auto last = start;
  auto on_body = [&](const std::string& text) {
    const auto now = Clock::now();
    for (size_t end; (end = text.find("\n\n", scanned)) != std::string::npos; scanned = end + 2) {
      const std::string event = text.substr(scanned, end - scanned);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string data = event.substr(6);
      if (data == "[DONE]") {
        done = true;
        continue;
      }
      json j = json::parse(data, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        r.error = j["error"].value("message", j["error"].dump());
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        r.prompt_tokens = j["usage"].value("prompt_tokens", size_t{0});
        r.output_tokens = j["usage"].value("completion_tokens", size_t{0});
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const json& c = j["choices"][0];
      const bool text_piece =
          (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) ||
          (c.contains("delta") && c["delta"].contains("content") &&
           c["delta"]["content"].is_string() && !c["delta"]["content"].get<std::string>().empty());
      if (!text_piece) continue;
      if (events++ == 0) {
        r.ttft = seconds(now - start);
      } else {
        r.itl.push_back(seconds(now - last));
      }
      last = now;
    }
  };
  std::string whole;
  auto status = http_call(u, http::verb::post, o.endpoint, body.dump(), key, on_body, &whole);
  r.e2el = seconds(Clock::now() - start);
  if (!status) {
    r.error = status.status().message();
  } else if (*status != 200) {
    json j = json::parse(whole, nullptr, false);
    r.error = "HTTP " + std::to_string(*status) +
              (!j.is_discarded() && j.contains("error") ? ": " + j["error"].value("message", "")
                                                        : std::string());
  } else if (r.error.empty() && !done) {
    r.error = "the stream ended without data: [DONE]";
  }
  if (r.output_tokens == 0) r.output_tokens = events;
  r.ok = r.error.empty() && events > 0;
  if (r.error.empty() && events == 0) r.error = "no tokens streamed";
  return r;
}

// mean, p50, p90, p99 in milliseconds of `seconds_values`.
json summary(const std::vector<double>& seconds_values) {
  std::vector<double> ms;
  for (double s : seconds_values) ms.push_back(s * 1000.0);
  const double mean =
      ms.empty() ? 0.0
                 : std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  return {{"mean", mean},
          {"p50", percentile(ms, 50)},
          {"p90", percentile(ms, 90)},
          {"p99", percentile(ms, 99)}};
}

// --goodput "ttft:500" "tpot:50" "e2el:2000": SLOs in milliseconds by metric.
Expected<std::map<std::string, double>> parse_goodput(const std::vector<std::string>& items) {
  std::map<std::string, double> slo;
  for (const std::string& item : items) {
    const size_t colon = item.find(':');
    const std::string name = item.substr(0, colon);
    char* end = nullptr;
    const double ms = colon == std::string::npos ? -1 : std::strtod(item.c_str() + colon + 1, &end);
    if ((name != "ttft" && name != "tpot" && name != "e2el") || !(ms > 0) || *end != '\0') {
      return invalid_argument("--goodput " + item +
                              ": expected ttft:MS, tpot:MS or e2el:MS with MS > 0");
    }
    slo[name] = ms;
  }
  return slo;
}

// The API key: --api-key, else $TESSERA_API_KEY, else $OPENAI_API_KEY ("" for none).
std::string api_key(const BenchServeOptions& o) {
  std::string key = o.api_key;
  for (const char* env : {"TESSERA_API_KEY", "OPENAI_API_KEY"}) {
    if (key.empty() && std::getenv(env) != nullptr) key = std::getenv(env);
  }
  return key;
}

// The model to ask for: --model, else the first model the server's /v1/models lists.
Expected<std::string> served_model(const Url& url, const BenchServeOptions& o,
                                   const std::string& key) {
  if (!o.model.empty()) return o.model;
  std::string listing;
  TESSERA_ASSIGN_OR_RETURN(int status,
                           http_call(url, http::verb::get, "/v1/models", "", key, {}, &listing));
  json j = json::parse(listing, nullptr, false);
  if (status == 401) {
    return unavailable("GET " + o.base_url +
                       "/v1/models answered 401: the server wants an API "
                       "key (--api-key, $TESSERA_API_KEY or $OPENAI_API_KEY)");
  }
  if (status != 200 || j.is_discarded() || !j.contains("data") || j["data"].empty()) {
    return unavailable("GET " + o.base_url + "/v1/models answered " + std::to_string(status) + " " +
                       listing.substr(0, 200) + ": name the model with --model");
  }
  return j["data"][0].value("id", "");
}

// The requests: --num-prompts random ones, or the first of --dataset-path.
Expected<std::vector<BenchPrompt>> bench_prompts(const BenchServeOptions& o) {
  if (!o.dataset_path.empty()) {
    return read_bench_dataset(o.dataset_path, o.num_prompts, o.output_len, INT32_MAX);
  }
  if (o.input_len == 0 || o.output_len == 0) {
    return invalid_argument("--input-len and --output-len must be at least 1");
  }
  return random_bench_prompts(o.num_prompts, o.input_len, o.output_len, o.seed);
}

// Sends every prompt, each on a thread of its own: at Poisson arrivals of --request-rate (all at
// once without one), at most --max-concurrency in flight. Every tenth finished is said on
// stderr. The results in the prompts' order, and the seconds from the first send to the last
// answer in `duration`.
std::vector<RequestResult> send_requests(const Url& url, const BenchServeOptions& o,
                                         const std::string& model, const std::string& key,
                                         const std::vector<BenchPrompt>& prompts,
                                         double& duration) {
  std::vector<RequestResult> results(prompts.size());
  std::counting_semaphore<1 << 20> slots(o.max_concurrency > 0 ? o.max_concurrency : (1 << 20));
  std::mutex mu;
  size_t finished = 0, next_tenth = 1;
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(o.request_rate > 0 ? o.request_rate : 1.0);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  auto next_arrival = t0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (o.request_rate > 0 && i > 0) {
      next_arrival +=
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
      std::this_thread::sleep_until(next_arrival);
    }
    slots.acquire();
    threads.emplace_back([&, i] {
      results[i] = run_request(url, o, model, key, prompts[i]);
      slots.release();
      std::lock_guard lock(mu);
      ++finished;
      if (finished * 10 >= next_tenth * prompts.size()) {
        while (finished * 10 >= next_tenth * prompts.size()) ++next_tenth;
        std::fprintf(stderr, "bench serve: %zu of %zu requests done (%.1f s)\n", finished,
                     prompts.size(), seconds(Clock::now() - t0));
      }
    });
  }
  for (auto& t : threads) t.join();
  duration = seconds(Clock::now() - t0);
  return results;
}

// The requests' figures gathered: the successful ones' timings (seconds) and tokens, how many
// met every --goodput SLO, and the failures by error.
struct Tally {
  std::vector<double> ttft, tpot, itl, e2el;
  size_t completed = 0, input_tokens = 0, output_tokens = 0, good = 0;
  std::map<std::string, size_t> errors;
};

Tally tally(const std::vector<RequestResult>& results, const std::map<std::string, double>& slo) {
  Tally t;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      ++t.errors[r.error];
      continue;
    }
    ++t.completed;
    t.input_tokens += r.prompt_tokens;
    t.output_tokens += r.output_tokens;
    t.ttft.push_back(r.ttft);
    t.e2el.push_back(r.e2el);
    t.itl.insert(t.itl.end(), r.itl.begin(), r.itl.end());
    const double tpot =
        r.output_tokens > 1 ? (r.e2el - r.ttft) / static_cast<double>(r.output_tokens - 1) : 0.0;
    if (r.output_tokens > 1) t.tpot.push_back(tpot);
    bool meets = true;
    if (slo.count("ttft")) meets &= r.ttft * 1000 <= slo.at("ttft");
    if (slo.count("tpot")) meets &= tpot * 1000 <= slo.at("tpot");
    if (slo.count("e2el")) meets &= r.e2el * 1000 <= slo.at("e2el");
    t.good += meets;
  }
  return t;
}

// The run as --output-json writes it: the command, the workload, and every figure.
json results_json(const BenchServeOptions& o, const std::string& model, size_t num_prompts,
                  const Tally& t, double duration, const std::map<std::string, double>& slo) {
  json out = {{"command", o.command_line},
              {"base_url", o.base_url},
              {"endpoint", o.endpoint},
              {"model", model},
              {"num_prompts", num_prompts},
              {"dataset", o.dataset_path.empty() ? "random" : o.dataset_path},
              {"input_len", o.dataset_path.empty() ? o.input_len : 0},
              {"output_len", o.dataset_path.empty() ? o.output_len : 0},
              {"request_rate", o.request_rate > 0 ? json(o.request_rate) : json("inf")},
              {"max_concurrency", o.max_concurrency > 0 ? json(o.max_concurrency) : json(nullptr)},
              {"completed", t.completed},
              {"failed", num_prompts - t.completed},
              {"duration_s", duration},
              {"total_input_tokens", t.input_tokens},
              {"total_output_tokens", t.output_tokens},
              {"request_throughput", t.completed / duration},
              {"output_throughput", t.output_tokens / duration},
              {"total_token_throughput", (t.input_tokens + t.output_tokens) / duration},
              {"ttft_ms", summary(t.ttft)},
              {"tpot_ms", summary(t.tpot)},
              {"itl_ms", summary(t.itl)},
              {"e2el_ms", summary(t.e2el)}};
  if (!slo.empty()) {
    out["goodput_slo_ms"] = slo;
    out["goodput"] = t.good / duration;
  }
  json errs = json::object();
  for (const auto& [e, n] : t.errors) errs[e] = n;
  out["errors"] = errs;
  return out;
}

// The human-readable report of `out` (results_json's) as vLLM prints it.
void print_results(const BenchOutput& text, const json& out, const Tally& t, size_t num_prompts,
                   double duration, bool goodput) {
  text.say("%-32s %12zu\n%-32s %12zu\n%-32s %12.2f\n%-32s %12zu\n%-32s %12zu\n",
           "Successful requests:", t.completed, "Failed requests:", num_prompts - t.completed,
           "Duration (s):", duration, "Total input tokens:", t.input_tokens,
           "Total generated tokens:", t.output_tokens);
  text.say("%-32s %12.2f\n%-32s %12.2f\n%-32s %12.2f\n",
           "Request throughput (req/s):", t.completed / duration,
           "Output token throughput (tok/s):", t.output_tokens / duration,
           "Total token throughput (tok/s):", (t.input_tokens + t.output_tokens) / duration);
  if (goodput) text.say("%-32s %12.2f\n", "Goodput (req/s):", t.good / duration);
  for (const char* name : {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}) {
    const json& s = out[name];
    text.say("%-8s mean %10.2f  p50 %10.2f  p90 %10.2f  p99 %10.2f  (ms)\n", name,
             s["mean"].get<double>(), s["p50"].get<double>(), s["p90"].get<double>(),
             s["p99"].get<double>());
  }
  for (const auto& [e, n] : t.errors) text.say("  %zu failed: %s\n", n, e.c_str());
}

Status run(const BenchServeOptions& o) {
  const BenchOutput text(o.json);
  if (o.num_prompts == 0) return invalid_argument("--num-prompts must be at least 1");
  if (o.request_rate < 0) return invalid_argument("--request-rate must be positive (or inf)");
  TESSERA_ASSIGN_OR_RETURN(Url url, parse_url(o.base_url));
  TESSERA_ASSIGN_OR_RETURN(auto slo, parse_goodput(o.goodput));
  const std::string key = api_key(o);
  TESSERA_ASSIGN_OR_RETURN(const std::string model, served_model(url, o, key));
  TESSERA_ASSIGN_OR_RETURN(const std::vector<BenchPrompt> prompts, bench_prompts(o));
  text.say("bench serve: %zu requests to %s%s (model %s), %s, %s\n", prompts.size(),
           o.base_url.c_str(), o.endpoint.c_str(), model.c_str(),
           o.request_rate > 0 ? ("Poisson " + std::to_string(o.request_rate) + " req/s").c_str()
                              : "all at once",
           o.max_concurrency > 0 ? ("at most " + std::to_string(o.max_concurrency)).c_str()
                                 : "no concurrency limit");
  std::fflush(stdout);

  double duration = 0;
  const std::vector<RequestResult> results = send_requests(url, o, model, key, prompts, duration);
  const Tally t = tally(results, slo);
  const json out = results_json(o, model, prompts.size(), t, duration, slo);
  print_results(text, out, t, prompts.size(), duration, !slo.empty());
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, out));
  if (t.completed == 0) {
    return unavailable("no request succeeded; the first error: " +
                       (t.errors.empty() ? std::string("none") : t.errors.begin()->first));
  }
  return Status::ok();
}

}  // namespace

CLI::App* add_bench_serve_subcommand(CLI::App& bench, BenchServeOptions& o) {
  auto* cmd = bench.add_subcommand(
      "serve", "Online: streamed requests against a running OpenAI-compatible server (vLLM's)");
  cmd->add_option("--base-url", o.base_url, "The server (http://127.0.0.1:8000)");
  cmd->add_option("--endpoint", o.endpoint, "The completions path (/v1/completions)");
  cmd->add_option("--model", o.model, "The model name (default: the first of /v1/models)");
  cmd->add_option("--api-key", o.api_key,
                  "Bearer key (default: $TESSERA_API_KEY, then $OPENAI_API_KEY)");
  cmd->add_option("--num-prompts", o.num_prompts, "Requests (1000)");
  cmd->add_option("--input-len,--random-input-len", o.input_len, "Random prompt tokens (1024)");
  cmd->add_option("--output-len,--random-output-len", o.output_len, "Tokens each asks (128)");
  cmd->add_option("--dataset-path", o.dataset_path,
                  "JSONL of prompts: \"prompt\" or \"prompt_token_ids\", optional \"output_len\"");
  cmd->add_option_function<std::string>(
      "--request-rate",
      [&o](const std::string& v) {
        o.request_rate = v == "inf" ? 0.0 : std::strtod(v.c_str(), nullptr);
        if (v != "inf" && !(o.request_rate > 0)) {
          throw CLI::ValidationError("--request-rate", "a positive number or inf");
        }
      },
      "Requests per second, Poisson arrivals (inf: all at once, the default)");
  cmd->add_option("--max-concurrency", o.max_concurrency, "Requests in flight at most (no limit)");
  cmd->add_flag("--ignore-eos", o.ignore_eos, "Ask every request for all of its tokens");
  cmd->add_option_function<double>(
      "--temperature", [&o](double t) { o.temperature = t; },
      "Sampling temperature (default: the server's)");
  cmd->add_option("--seed", o.seed, "The run's random seed: prompts and arrival times (0)");
  cmd->add_option("--goodput", o.goodput, "SLOs for goodput: ttft:MS tpot:MS e2el:MS")
      ->expected(1, 3);
  add_bench_output_options(cmd, o.output_json, o.json);
  add_examples(cmd, {"tessera bench serve --base-url http://127.0.0.1:8000 "
                     "--num-prompts 200 --max-concurrency 32"});
  return cmd;
}

int bench_serve_command(const BenchServeOptions& options) {
  return command_exit(run(options), "tessera bench serve");
}

}  // namespace tessera::server
