#include "driver/server/bench_serve.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <semaphore>
#include <sstream>
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

// The dataset and its parameters, as --output-json records them.
json dataset_json(const BenchServeOptions& o, BenchServeDataset d) {
  json params;
  switch (d) {
    case BenchServeDataset::kRandom:
      params = {{"input_len", o.input_len}, {"output_len", o.output_len}};
      break;
    case BenchServeDataset::kPrefixRepetition: {
      const PrefixRepetitionOptions& p = o.prefix_repetition;
      params = {{"prefix_len", p.prefix_len},
                {"suffix_len", p.suffix_len},
                {"num_prefixes", p.num_prefixes},
                {"output_len", p.output_len}};
      break;
    }
    case BenchServeDataset::kCustom:
      params = {{"path", o.dataset_path}, {"output_len", o.output_len}};
      break;
  }
  return params;
}

// The machine the benchmark ran on (the client's; the server may be elsewhere).
json machine_json() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  utsname u{};
  uname(&u);
  return {{"hostname", host},
          {"os", std::string(u.sysname) + " " + u.release},
          {"arch", u.machine},
          {"cpus", std::thread::hardware_concurrency()}};
}

// The commit: $TESSERA_COMMIT, else the HEAD of the git checkout this executable sits in (a
// build directory inside the source tree), else null.
json commit_json() {
  if (const char* c = std::getenv("TESSERA_COMMIT"); c != nullptr && *c != '\0') return c;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return nullptr;
  std::string quoted = "'";
  for (char ch : exe.parent_path().string())
    quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  quoted += "'";
  FILE* git = ::popen(("git -C " + quoted + " rev-parse HEAD 2>/dev/null").c_str(), "r");
  if (git == nullptr) return nullptr;
  char buf[128] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, git);
  const int rc = ::pclose(git);
  std::string sha(buf, n);
  while (!sha.empty() && std::isspace(static_cast<unsigned char>(sha.back()))) sha.pop_back();
  const bool hex = sha.size() == 40 && std::all_of(sha.begin(), sha.end(), [](char c) {
                     return std::isxdigit(static_cast<unsigned char>(c));
                   });
  return rc == 0 && hex ? json(sha) : json(nullptr);
}

// The server's version from GET /version ({"version": ...}, ours and vLLM's), or null.
json server_version(const Url& url, const std::string& key) {
  std::string body;
  auto status = http_call(url, http::verb::get, "/version", "", key, {}, &body);
  if (!status || *status != 200) return nullptr;
  json j = json::parse(body, nullptr, false);
  return !j.is_discarded() && j.is_object() && j.contains("version") ? j["version"] : json(nullptr);
}

// The server's counters now, from GET /metrics; the error says why there are none.
Expected<ServerCounters> scrape_metrics(const Url& url, const std::string& key) {
  std::string body;
  TESSERA_ASSIGN_OR_RETURN(int status,
                           http_call(url, http::verb::get, "/metrics", "", key, {}, &body));
  if (status != 200) return unavailable("GET /metrics answered " + std::to_string(status));
  Expected<ServerCounters> counters = parse_server_metrics(body);
  if (!counters) return counters.status().with_context("GET /metrics");
  return counters;
}

// The run's server figures from the counters before and after it.
Expected<ServerCacheFigures> run_figures(const Expected<ServerCounters>& before,
                                         const Expected<ServerCounters>& after) {
  if (!before) return before.status();
  if (!after) return after.status();
  Expected<ServerCacheFigures> f = server_cache_figures(*before, *after);
  if (!f) return f.status().with_context("GET /metrics");
  return f;
}

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

// The server's figures as --output-json records them: null where it has none.
json server_json(const Expected<ServerCacheFigures>& f, bool tessera) {
  json out = {{"server_metrics", nullptr},
              {"prefix_cache_queries", nullptr},
              {"prefix_cache_hits", nullptr},
              {"prefix_cache_hit_rate", nullptr},
              {"replica_requests_routed", nullptr},
              {"replica_max_share", nullptr},
              {"replica_prefix_cache_hit_rate", nullptr},
              {"router_decision_mean_ms", nullptr}};
  if (!f) {
    out["server_metrics_error"] = f.status().message();
    return out;
  }
  out["server_metrics"] = tessera ? "tessera" : "vllm";
  out["prefix_cache_queries"] = f->prefix_cache_queries;
  out["prefix_cache_hits"] = f->prefix_cache_hits;
  out["prefix_cache_hit_rate"] = optional_json(f->prefix_cache_hit_rate);
  if (!f->replica_requests_routed.empty()) {
    out["replica_requests_routed"] = f->replica_requests_routed;
    out["replica_max_share"] = optional_json(f->replica_max_share);
    json rates = json::array();
    for (const auto& r : f->replica_prefix_cache_hit_rate) rates.push_back(optional_json(r));
    out["replica_prefix_cache_hit_rate"] = rates;
  }
  out["router_decision_mean_ms"] = optional_json(f->router_decision_mean_ms);
  return out;
}

// One run: what was asked, what came back, and the server's side of it.
struct RunRecord {
  std::string model;
  BenchServeDataset dataset = BenchServeDataset::kRandom;
  size_t num_prompts = 0;
  Tally tally;
  double duration = 0;
  std::map<std::string, double> slo;
  Expected<ServerCacheFigures> server = internal_error("not scraped");
  bool tessera = false;  // the server's /metrics are ours
  json server_version;
};

// The run as --output-json writes it: the command, the machine and commit, the workload, and
// every figure, the server's included.
json results_json(const BenchServeOptions& o, const RunRecord& r) {
  const Tally& t = r.tally;
  const double duration = r.duration;
  const bool prefixed = r.dataset == BenchServeDataset::kPrefixRepetition;
  const PrefixRepetitionOptions& p = o.prefix_repetition;
  json out = {{"command", o.command_line},
              {"machine", machine_json()},
              {"commit", commit_json()},
              {"base_url", o.base_url},
              {"endpoint", o.endpoint},
              {"model", r.model},
              {"server_version", r.server_version},
              {"num_prompts", r.num_prompts},
              {"dataset", bench_serve_dataset_name(r.dataset)},
              {"dataset_params", dataset_json(o, r.dataset)},
              {"input_len", r.dataset == BenchServeDataset::kRandom ? o.input_len
                            : prefixed                              ? p.prefix_len + p.suffix_len
                                                                    : 0u},
              {"output_len", r.dataset == BenchServeDataset::kRandom ? o.output_len
                             : prefixed                              ? p.output_len
                                                                     : 0u},
              {"seed", o.seed},
              {"request_rate", o.request_rate > 0 ? json(o.request_rate) : json("inf")},
              {"max_concurrency", o.max_concurrency > 0 ? json(o.max_concurrency) : json(nullptr)},
              {"completed", t.completed},
              {"failed", r.num_prompts - t.completed},
              {"duration_s", duration},
              {"total_input_tokens", t.input_tokens},
              {"total_output_tokens", t.output_tokens},
              {"request_throughput", t.completed / duration},
              {"output_throughput", t.output_tokens / duration},
              {"total_token_throughput", (t.input_tokens + t.output_tokens) / duration},
              {"ttft_ms", summary(t.ttft)},
              {"tpot_ms", summary(t.tpot)},
              {"itl_ms", summary(t.itl)},
              {"e2el_ms", summary(t.e2el)},
              {"goodput_slo_ms", r.slo.empty() ? json(nullptr) : json(r.slo)},
              {"goodput", r.slo.empty() ? json(nullptr) : json(t.good / duration)}};
  out.update(server_json(r.server, r.tessera));
  json errs = json::object();
  for (const auto& [e, n] : t.errors) errs[e] = n;
  out["errors"] = errs;
  return out;
}

// The server's lines of the report: its prefix cache over the run and, behind a router, each
// replica's share; one line saying why when its /metrics have none.
void print_server(const BenchOutput& text, const Expected<ServerCacheFigures>& f) {
  if (!f) {
    text.say("Server cache figures: none (%s)\n", f.status().message().c_str());
    return;
  }
  if (f->prefix_cache_hit_rate) {
    text.say("%-32s %12.2f  (%.0f of %.0f prompt tokens)\n",
             "Prefix cache hit rate (%):", 100 * *f->prefix_cache_hit_rate, f->prefix_cache_hits,
             f->prefix_cache_queries);
  } else {
    text.say("%-32s %12s  (no prefix-cache queries: caching off?)\n",
             "Prefix cache hit rate (%):", "-");
  }
  if (f->replica_requests_routed.empty()) return;
  std::string routed;
  for (size_t i = 0; i < f->replica_requests_routed.size(); ++i) {
    char cell[64];
    const auto& rate = f->replica_prefix_cache_hit_rate[i];
    std::snprintf(
        cell, sizeof(cell), "%s%.0f (hits %s)", i ? ", " : "", f->replica_requests_routed[i],
        rate ? (std::to_string(static_cast<int>(std::lround(100 * *rate))) + "%").c_str() : "-");
    routed += cell;
  }
  text.say("%-32s %s\n", "Requests per replica:", routed.c_str());
  if (f->replica_max_share) {
    text.say("%-32s %12.2f\n", "Max replica share (%):", 100 * *f->replica_max_share);
  }
  if (f->router_decision_mean_ms) {
    text.say("%-32s %12.4f\n", "Router decision mean (ms):", *f->router_decision_mean_ms);
  }
}

// The human-readable report of `out` (results_json's) as vLLM prints it.
void print_results(const BenchOutput& text, const json& out, const RunRecord& r) {
  const Tally& t = r.tally;
  const double duration = r.duration;
  text.say("%-32s %12zu\n%-32s %12zu\n%-32s %12.2f\n%-32s %12zu\n%-32s %12zu\n",
           "Successful requests:", t.completed, "Failed requests:", r.num_prompts - t.completed,
           "Duration (s):", duration, "Total input tokens:", t.input_tokens,
           "Total generated tokens:", t.output_tokens);
  text.say("%-32s %12.2f\n%-32s %12.2f\n%-32s %12.2f\n",
           "Request throughput (req/s):", t.completed / duration,
           "Output token throughput (tok/s):", t.output_tokens / duration,
           "Total token throughput (tok/s):", (t.input_tokens + t.output_tokens) / duration);
  if (!r.slo.empty()) text.say("%-32s %12.2f\n", "Goodput (req/s):", t.good / duration);
  print_server(text, r.server);
  for (const char* name : {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}) {
    const json& s = out[name];
    text.say("%-8s mean %10.2f  p50 %10.2f  p90 %10.2f  p99 %10.2f  (ms)\n", name,
             s["mean"].get<double>(), s["p50"].get<double>(), s["p90"].get<double>(),
             s["p99"].get<double>());
  }
  for (const auto& [e, n] : t.errors) text.say("  %zu failed: %s\n", n, e.c_str());
}

// "random, 1000 requests" / "prefix_repetition: 64 prefixes of 1000 tokens, ..." for the
// first line of the report.
std::string workload_line(const BenchServeOptions& o, BenchServeDataset d, size_t n) {
  const PrefixRepetitionOptions& p = o.prefix_repetition;
  std::string line = std::to_string(n) + " requests (" + bench_serve_dataset_name(d);
  if (d == BenchServeDataset::kPrefixRepetition) {
    line += ": " + std::to_string(p.num_prefixes) + " prefixes of " + std::to_string(p.prefix_len) +
            " tokens, suffixes of " + std::to_string(p.suffix_len) + ", " +
            std::to_string(p.output_len) + " out";
  }
  return line + ")";
}

Status run(const BenchServeOptions& o) {
  const BenchOutput text(o.json);
  if (o.request_rate < 0) return invalid_argument("--request-rate must be positive (or inf)");
  RunRecord r;
  TESSERA_ASSIGN_OR_RETURN(r.dataset, bench_serve_dataset(o));
  TESSERA_ASSIGN_OR_RETURN(Url url, parse_url(o.base_url));
  TESSERA_ASSIGN_OR_RETURN(r.slo, parse_goodput(o.goodput));
  TESSERA_ASSIGN_OR_RETURN(const std::vector<BenchPrompt> prompts, bench_serve_prompts(o));
  r.num_prompts = prompts.size();
  const std::string key = api_key(o);
  TESSERA_ASSIGN_OR_RETURN(r.model, served_model(url, o, key));
  r.server_version = server_version(url, key);
  text.say("bench serve: %s to %s%s (model %s), %s, %s\n",
           workload_line(o, r.dataset, prompts.size()).c_str(), o.base_url.c_str(),
           o.endpoint.c_str(), r.model.c_str(),
           o.request_rate > 0 ? ("Poisson " + std::to_string(o.request_rate) + " req/s").c_str()
                              : "all at once",
           o.max_concurrency > 0 ? ("at most " + std::to_string(o.max_concurrency)).c_str()
                                 : "no concurrency limit");
  std::fflush(stdout);

  const Expected<ServerCounters> before = scrape_metrics(url, key);
  const std::vector<RequestResult> results =
      send_requests(url, o, r.model, key, prompts, r.duration);
  const Expected<ServerCounters> after =
      before ? scrape_metrics(url, key) : Expected<ServerCounters>(before.status());
  r.server = run_figures(before, after);
  r.tessera = after && after->tessera;
  r.tally = tally(results, r.slo);
  const json out = results_json(o, r);
  print_results(text, out, r);
  TESSERA_RETURN_IF_ERROR(text.finish(o.output_json, out));
  if (r.tally.completed == 0) {
    return unavailable(
        "no request succeeded; the first error: " +
        (r.tally.errors.empty() ? std::string("none") : r.tally.errors.begin()->first));
  }
  return Status::ok();
}

}  // namespace

const char* bench_serve_dataset_name(BenchServeDataset d) {
  switch (d) {
    case BenchServeDataset::kRandom:
      return "random";
    case BenchServeDataset::kPrefixRepetition:
      return "prefix_repetition";
    case BenchServeDataset::kCustom:
      return "custom";
  }
  return "?";
}

Expected<BenchServeDataset> bench_serve_dataset(const BenchServeOptions& o) {
  const BenchServeDataset d = o.dataset.value_or(
      o.dataset_path.empty() ? BenchServeDataset::kRandom : BenchServeDataset::kCustom);
  if (o.num_prompts == 0) return invalid_argument("--num-prompts must be at least 1");
  if (d != BenchServeDataset::kCustom && !o.dataset_path.empty()) {
    return invalid_argument("--dataset-path " + o.dataset_path +
                            " is for --dataset-name custom, not " + bench_serve_dataset_name(d));
  }
  switch (d) {
    case BenchServeDataset::kRandom:
      if (o.input_len == 0) return invalid_argument("--input-len must be at least 1");
      if (o.output_len == 0) return invalid_argument("--output-len must be at least 1");
      break;
    case BenchServeDataset::kCustom:
      if (o.dataset_path.empty()) {
        return invalid_argument("--dataset-name custom needs --dataset-path (a JSONL of prompts)");
      }
      if (o.output_len == 0) return invalid_argument("--output-len must be at least 1");
      break;
    case BenchServeDataset::kPrefixRepetition: {
      const PrefixRepetitionOptions& p = o.prefix_repetition;
      if (p.num_prefixes == 0) {
        return invalid_argument("--prefix-repetition-num-prefixes must be at least 1");
      }
      if (o.num_prompts < p.num_prefixes) {
        return invalid_argument("--num-prompts " + std::to_string(o.num_prompts) +
                                " is fewer than --prefix-repetition-num-prefixes " +
                                std::to_string(p.num_prefixes) +
                                ": every prefix needs at least one request");
      }
      if (p.prefix_len == 0 && p.suffix_len == 0) {
        return invalid_argument(
            "--prefix-repetition-prefix-len and --prefix-repetition-suffix-len are both 0: the "
            "prompts would be empty");
      }
      if (p.output_len == 0) {
        return invalid_argument("--prefix-repetition-output-len must be at least 1");
      }
      break;
    }
  }
  return d;
}

Expected<std::vector<BenchPrompt>> prefix_repetition_prompts(uint32_t num_prompts,
                                                             const PrefixRepetitionOptions& p,
                                                             uint64_t seed) {
  BenchServeOptions o;
  o.dataset = BenchServeDataset::kPrefixRepetition;
  o.num_prompts = num_prompts;
  o.prefix_repetition = p;
  TESSERA_RETURN_IF_ERROR(bench_serve_dataset(o).status());
  std::mt19937_64 rng(seed);
  const uint64_t prefix_seed = rng(), suffix_seed = rng();
  const std::vector<BenchPrompt> prefixes =
      random_bench_prompts(p.num_prefixes, p.prefix_len, p.output_len, prefix_seed);
  std::vector<BenchPrompt> out =
      random_bench_prompts(num_prompts, p.suffix_len, p.output_len, suffix_seed);
  for (size_t i = 0; i < out.size(); ++i) {
    const std::vector<int32_t>& prefix = prefixes[i % p.num_prefixes].ids;
    out[i].ids.insert(out[i].ids.begin(), prefix.begin(), prefix.end());
  }
  // Fisher-Yates with the generator's own numbers (std::shuffle's order differs between
  // standard libraries): the same seed, the same order everywhere.
  for (size_t i = out.size(); i > 1; --i) std::swap(out[i - 1], out[rng() % i]);
  return out;
}

Expected<std::vector<BenchPrompt>> bench_serve_prompts(const BenchServeOptions& o) {
  TESSERA_ASSIGN_OR_RETURN(const BenchServeDataset d, bench_serve_dataset(o));
  switch (d) {
    case BenchServeDataset::kRandom:
      return random_bench_prompts(o.num_prompts, o.input_len, o.output_len, o.seed);
    case BenchServeDataset::kPrefixRepetition:
      return prefix_repetition_prompts(o.num_prompts, o.prefix_repetition, o.seed);
    case BenchServeDataset::kCustom:
      break;
  }
  return read_bench_dataset(o.dataset_path, o.num_prompts, o.output_len, INT32_MAX);
}

namespace {

// One sample of a Prometheus text line: name{label="value",...} value [timestamp].
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::optional<Sample> parse_sample(const std::string& line) {
  if (line.empty() || line[0] == '#') return std::nullopt;
  Sample s;
  size_t i = line.find_first_of("{ ");
  if (i == std::string::npos || i == 0) return std::nullopt;
  s.name = line.substr(0, i);
  if (line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      const size_t eq = line.find('=', i);
      if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
        return std::nullopt;
      }
      const std::string key = line.substr(i, eq - i);
      std::string value;
      for (i = eq + 2; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\' && i + 1 < line.size()) ++i;  // \" \\ \n
        value += line[i];
      }
      if (i >= line.size()) return std::nullopt;
      s.labels[key] = value;
      ++i;  // the closing quote
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return std::nullopt;
    ++i;  // '}'
  }
  const char* start = line.c_str() + i;
  char* end = nullptr;
  s.value = std::strtod(start, &end);
  if (end == start) return std::nullopt;
  return s;
}

}  // namespace

Expected<ServerCounters> parse_server_metrics(const std::string& text) {
  ServerCounters c;
  bool queries = false, hits = false;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::optional<Sample> s = parse_sample(line);
    if (!s) continue;
    c.tessera |= s->name.rfind("tessera:", 0) == 0;
    std::optional<uint32_t> replica;
    if (auto r = s->labels.find("replica"); r != s->labels.end()) {
      char* end = nullptr;
      const unsigned long v = std::strtoul(r->second.c_str(), &end, 10);
      if (!r->second.empty() && *end == '\0') replica = static_cast<uint32_t>(v);
    }
    if (s->name == "vllm:prefix_cache_queries_total") {
      c.prefix_cache_queries += s->value;
      queries = true;
    } else if (s->name == "vllm:prefix_cache_hits_total") {
      c.prefix_cache_hits += s->value;
      hits = true;
    } else if (s->name == "tessera:router_decision_seconds_count") {
      c.router_decisions += s->value;
    } else if (s->name == "tessera:router_decision_seconds_sum") {
      c.router_decision_seconds += s->value;
    } else if (replica && s->name == "tessera:replica_requests_routed") {
      c.routed[*replica] += s->value;
    } else if (replica && s->name == "tessera:replica_prefix_cache_queries") {
      c.replica_queries[*replica] += s->value;
    } else if (replica && s->name == "tessera:replica_prefix_cache_hits") {
      c.replica_hits[*replica] += s->value;
    }
  }
  if (!queries || !hits) {
    return failed_precondition(
        "no vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total in it: not a "
        "tessera (or vLLM) server");
  }
  return c;
}

Expected<ServerCacheFigures> server_cache_figures(const ServerCounters& before,
                                                  const ServerCounters& after) {
  bool went_back = false;
  auto delta = [&](double b, double a) {
    went_back |= a < b;
    return a - b;
  };
  auto at = [](const std::map<uint32_t, double>& m, uint32_t i) {
    auto it = m.find(i);
    return it == m.end() ? 0.0 : it->second;
  };
  ServerCacheFigures f;
  f.prefix_cache_queries = delta(before.prefix_cache_queries, after.prefix_cache_queries);
  f.prefix_cache_hits = delta(before.prefix_cache_hits, after.prefix_cache_hits);
  if (f.prefix_cache_queries > 0) {
    f.prefix_cache_hit_rate = f.prefix_cache_hits / f.prefix_cache_queries;
  }
  if (!after.routed.empty()) {
    const uint32_t n = after.routed.rbegin()->first + 1;  // replicas keep their index
    double total = 0, most = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const double routed = delta(at(before.routed, i), at(after.routed, i));
      f.replica_requests_routed.push_back(routed);
      total += routed;
      most = std::max(most, routed);
      const double q = delta(at(before.replica_queries, i), at(after.replica_queries, i));
      const double h = delta(at(before.replica_hits, i), at(after.replica_hits, i));
      f.replica_prefix_cache_hit_rate.push_back(q > 0 ? std::optional<double>(h / q)
                                                      : std::nullopt);
    }
    if (total > 0) f.replica_max_share = most / total;
  }
  const double decisions = delta(before.router_decisions, after.router_decisions);
  if (decisions > 0) {
    f.router_decision_mean_ms =
        1000 * delta(before.router_decision_seconds, after.router_decision_seconds) / decisions;
  }
  if (went_back) {
    return failed_precondition("its counters went back during the run (did it restart?)");
  }
  return f;
}

CLI::App* add_bench_serve_subcommand(CLI::App& bench, BenchServeOptions& o) {
  auto* cmd = bench.add_subcommand(
      "serve", "Online: streamed requests against a running OpenAI-compatible server (vLLM's)");
  cmd->add_option("--base-url", o.base_url, "The server (http://127.0.0.1:8000)");
  cmd->add_option("--endpoint", o.endpoint, "The completions path (/v1/completions)");
  cmd->add_option("--model", o.model, "The model name (default: the first of /v1/models)");
  cmd->add_option("--api-key", o.api_key,
                  "Bearer key (default: $TESSERA_API_KEY, then $OPENAI_API_KEY)");
  cmd->add_option("--num-prompts", o.num_prompts, "Requests (1000)");
  cmd->add_option_function<std::string>(
      "--dataset-name",
      [&o](const std::string& v) {
        for (auto d : {BenchServeDataset::kRandom, BenchServeDataset::kPrefixRepetition,
                       BenchServeDataset::kCustom}) {
          if (v == bench_serve_dataset_name(d)) {
            o.dataset = d;
            return;
          }
        }
        throw CLI::ValidationError("--dataset-name",
                                   v + ": expected random, prefix_repetition or custom");
      },
      "random | prefix_repetition | custom (default: custom with --dataset-path, else random)");
  cmd->add_option("--input-len,--random-input-len", o.input_len, "random: prompt tokens (1024)");
  cmd->add_option("--output-len,--random-output-len", o.output_len,
                  "random and custom: tokens each asks (128)");
  cmd->add_option("--dataset-path", o.dataset_path,
                  "custom: JSONL of prompts, \"prompt\" or \"prompt_token_ids\", optional "
                  "\"output_len\"");
  PrefixRepetitionOptions& p = o.prefix_repetition;
  cmd->add_option("--prefix-repetition-prefix-len", p.prefix_len,
                  "prefix_repetition: tokens of each shared prefix (256)");
  cmd->add_option("--prefix-repetition-suffix-len", p.suffix_len,
                  "prefix_repetition: tokens after it, each request's own (256)");
  cmd->add_option("--prefix-repetition-num-prefixes", p.num_prefixes,
                  "prefix_repetition: prefixes, each shared by num-prompts / this (10)");
  cmd->add_option("--prefix-repetition-output-len", p.output_len,
                  "prefix_repetition: tokens each asks (128)");
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
                     "--num-prompts 200 --max-concurrency 32",
                     "tessera bench serve --dataset-name prefix_repetition "
                     "--prefix-repetition-prefix-len 1000 --prefix-repetition-suffix-len 50 "
                     "--prefix-repetition-num-prefixes 64 --num-prompts 512 --request-rate 16 "
                     "--goodput ttft:500 tpot:50"});
  return cmd;
}

int bench_serve_command(const BenchServeOptions& options) {
  return command_exit(run(options), "tessera bench serve");
}

}  // namespace tessera::server
