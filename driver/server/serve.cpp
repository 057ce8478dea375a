#include "driver/server/serve.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "common/tokenizer/tokenizer.h"
#include "driver/chat/chat_template.h"
#include "driver/chat_setup.h"
#include "driver/server/async_engine.h"
#include "driver/server/metrics.h"
#include "driver/server/openai_api.h"
#include "driver/server/replica_set.h"
#include "driver/server/response_writer.h"

namespace tessera::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::awaitable;
using asio::use_awaitable;
using nlohmann::json;
using nlohmann::ordered_json;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

CLI::App* add_serve_subcommand(CLI::App& app, ServeOptions& o) {
  auto* cmd = app.add_subcommand(
      "serve", "Serve a model over an OpenAI-compatible HTTP API (tessera serve MODEL_DIR ...)");
  add_engine_options(cmd, o.engine);
  cmd->add_option("--host", o.host, "Address to listen on (127.0.0.1)");
  cmd->add_option("--port", o.port, "Port to listen on (8000)");
  cmd->add_option("--served-model-name", o.served_model_name,
                  "Name(s) the API answers to (default: the --model argument)");
  cmd->add_option("--api-key", o.api_key,
                  "Clients must send 'Authorization: Bearer KEY' (default: $TESSERA_API_KEY)");
  cmd->add_option("--chat-template", o.chat_template,
                  "A chat template file, or the template itself (default: the tokenizer's)");
  cmd->add_option("--generation-config", o.generation_config,
                  "auto: sampling defaults from generation_config.json; vllm: none");
  cmd->add_flag("--enable-auto-tool-choice", o.enable_auto_tool_choice,
                "Parse tool calls in chat output (needs --tool-call-parser)");
  cmd->add_option("--tool-call-parser", o.tool_call_parser,
                  "How tool calls are written: hermes (<tool_call>{...}</tool_call>)");
  cmd->add_option("--max-connections", o.max_connections,
                  "Open HTTP connections at most; beyond it a new connection is answered 503 and "
                  "closed (1024)");
  cmd->add_option("--timeout-keep-alive", o.timeout_keep_alive,
                  "Seconds before an idle connection, or one still sending its request header, "
                  "is closed (5)");
  add_replica_options(cmd, o.replicas);
  cmd->footer("Example: tessera serve /models/Llama-3.1-8B-Instruct -tp 2 --port 8000");
  return cmd;
}

namespace {

// ---- one request's outputs, handed from the engine thread to the I/O thread ---------------

struct Pending {
  explicit Pending(asio::any_io_executor ex) : timer(ex) {
    timer.expires_at(Clock::time_point::max());
  }
  asio::steady_timer timer;  // cancelled to wake the waiting coroutine
  std::mutex mu;
  std::deque<std::pair<int, RequestOutput>> outputs;  // (choice index, output)
  bool disconnected = false;                          // I/O thread only
};

ApiError api_error(int status, std::string message, std::string type) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  return e;
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return std::string(prefix) + buf;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- connection limits ---------------------------------------------------------------------

// A request body may pause this long between reads before the connection is dropped.
constexpr auto kBodyReadGap = std::chrono::seconds(30);
// A connection whose request body is not read (401, 404, 413, ...) sends its answer and FIN,
// then discards what the client still sends, into one fixed buffer, for at most this long and
// this many bytes before it closes: a client still sending then reads the answer instead of
// meeting a reset that can discard it. Nothing of the body is kept.
constexpr auto kLingerTime = std::chrono::seconds(1);
constexpr size_t kLingerBytes = 1 << 20;
// Connections over --max-connections being answered 503 at once; beyond that they are closed
// without an answer.
constexpr size_t kMaxRefusing = 64;
// Accept failures (EMFILE: no descriptor left) are logged at most once per this long, and the
// accept loop waits between attempts while they last, 50 ms doubling up to 1 s.
constexpr auto kAcceptLogEvery = std::chrono::seconds(5);
constexpr auto kAcceptPauseMin = std::chrono::milliseconds(50);
constexpr auto kAcceptPauseMax = std::chrono::milliseconds(1000);

// At most one log line per `every`; counts the events in between that were not logged.
class Throttle {
 public:
  explicit Throttle(Clock::duration every) : every_(every) {}
  // True when this event is to be logged; `skipped` is then how many were not since the last.
  bool allow(uint64_t& skipped) {
    const auto now = Clock::now();
    if (logged_ && now - last_ < every_) {
      ++skipped_;
      return false;
    }
    logged_ = true;
    last_ = now;
    skipped = std::exchange(skipped_, 0);
    return true;
  }
  void reset() {
    logged_ = false;
    skipped_ = 0;
  }

 private:
  Clock::duration every_;
  Clock::time_point last_{};
  bool logged_ = false;
  uint64_t skipped_ = 0;
};

// " (N more not logged)" for a throttled log line, or "".
std::string not_logged(uint64_t skipped) {
  return skipped > 0 ? " (" + std::to_string(skipped) + " more not logged)" : std::string();
}

uint64_t descriptor_limit() {
  rlimit r{};
  return ::getrlimit(RLIMIT_NOFILE, &r) == 0 ? static_cast<uint64_t>(r.rlim_cur) : 0;
}

// Descriptors the server needs besides its connections (engine, logs, the node's sockets).
constexpr uint64_t kDescriptorReserve = 256;

// Raises the soft descriptor limit (ulimit -n) toward --max-connections plus a reserve, up to
// the hard limit; warns when that is not enough. Done before the local node starts, so that it
// inherits the same limit.
void fit_descriptor_limit(int max_connections) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const uint64_t want = static_cast<uint64_t>(max_connections) + kDescriptorReserve;
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < want) {
    rlimit raised = r;
    raised.rlim_cur = r.rlim_max == RLIM_INFINITY ? want : std::min<uint64_t>(r.rlim_max, want);
    if (raised.rlim_cur > r.rlim_cur && ::setrlimit(RLIMIT_NOFILE, &raised) == 0) r = raised;
  }
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < want) {
    spdlog::warn(
        "the descriptor limit (ulimit -n) is {} and its hard limit {}: fewer than "
        "--max-connections {} connections can be open (accept then fails until one closes); "
        "raise the hard limit or lower --max-connections",
        r.rlim_cur, r.rlim_max, max_connections);
  }
}

void set_cloexec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

// One HTTP connection. `count` (the server's open or refusing connections) is one higher while
// it lives. I/O thread only.
struct Conn {
  Conn(tcp::socket s, std::shared_ptr<size_t> count) : stream(std::move(s)), count_(count) {
    ++*count_;
  }
  ~Conn() { --*count_; }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  beast::tcp_stream stream;
  beast::flat_buffer buffer;

 private:
  std::shared_ptr<size_t> count_;
};

using Request = http::request<http::string_body>;
using Parser = http::request_parser<http::string_body>;

enum class Route {
  kNone,
  kHealth,
  kVersion,
  kMetrics,
  kModels,
  kCompletions,
  kChat,
  kGenerate,
  kTokenize,
  kDetokenize
};

Route route_of(const std::string& path) {
  static const std::map<std::string, Route, std::less<>> kRoutes = {
      {"/health", Route::kHealth},
      {"/version", Route::kVersion},
      {"/metrics", Route::kMetrics},
      {"/v1/models", Route::kModels},
      {"/v1/completions", Route::kCompletions},
      {"/v1/chat/completions", Route::kChat},
      {"/generate", Route::kGenerate},
      {"/tokenize", Route::kTokenize},
      {"/detokenize", Route::kDetokenize}};
  auto it = kRoutes.find(path);
  return it == kRoutes.end() ? Route::kNone : it->second;
}

// Routes open without the API key (and only for GET).
bool is_open_route(Route r) {
  return r == Route::kHealth || r == Route::kVersion || r == Route::kMetrics;
}

// What a worker makes of a POST body: the request for the engine, the JSON answer of
// /tokenize and /detokenize, or the error to send.
struct Prepared {
  std::optional<ApiError> error;
  ApiRequest request;
  std::string response;
};

class Server {
 public:
  Server(asio::io_context& ioc, ReplicaSet& engine, ServedModel model, const ServeOptions& o)
      : ioc_(ioc),
        engine_(engine),
        model_(std::move(model)),
        api_key_(o.api_key),
        max_request_bytes_(o.max_request_bytes),
        max_connections_(static_cast<size_t>(o.max_connections)),
        timeout_keep_alive_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(o.timeout_keep_alive))),
        workers_(std::clamp(std::thread::hardware_concurrency() / 2, 2u, 4u)) {}

  // Ends the workers (a running parse finishes first); before the engine and its tokenizer go.
  void stop_workers() {
    workers_.stop();
    workers_.join();
  }

  awaitable<void> accept_loop(tcp::acceptor& acceptor) {
    auto pause = kAcceptPauseMin;
    uint64_t failures = 0;  // since accept last worked
    while (acceptor.is_open()) {
      beast::error_code ec;
      co_await acceptor.async_wait(tcp::acceptor::wait_read,
                                   asio::redirect_error(use_awaitable, ec));
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) co_return;
      // accept4: close-on-exec from the start, so that no process forked meanwhile (the local
      // node, its actors) holds a client's connection.
      const int fd =
          ec ? -1
             : ::accept4(acceptor.native_handle(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        const int err = ec ? ec.value() : errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) continue;
        ++failures;
        uint64_t skipped = 0;
        if (accept_log_.allow(skipped)) {
          spdlog::warn(
              "accept failed: {}{}; new connections wait in the listen backlog until it works "
              "again ({} connections open, descriptor limit {}: raise `ulimit -n` or lower "
              "--max-connections {}); still serving",
              ec ? ec.message() : std::string(std::strerror(err)), not_logged(skipped), *open_,
              descriptor_limit(), max_connections_);
        }
        asio::steady_timer timer(ioc_, pause);
        co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
        pause = std::min<std::chrono::milliseconds>(pause * 2, kAcceptPauseMax);
        continue;
      }
      if (failures > 0) {
        spdlog::info("accept works again after {} failed attempts", failures);
        failures = 0;
        accept_log_.reset();
      }
      pause = kAcceptPauseMin;
      tcp::socket socket(ioc_);
      socket.assign(acceptor.local_endpoint(ec).protocol(), fd, ec);
      if (ec) {
        ::close(fd);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      if (*open_ >= max_connections_) {
        uint64_t skipped = 0;
        if (refuse_log_.allow(skipped)) {
          spdlog::warn(
              "{} connections are open (--max-connections): new ones are answered 503{}; raise "
              "--max-connections if the clients are legitimate",
              *open_, not_logged(skipped));
        }
        if (*refusing_ < kMaxRefusing) {
          asio::co_spawn(ioc_, refuse(std::make_shared<Conn>(std::move(socket), refusing_)),
                         asio::detached);
        }
        continue;  // else the socket closes here, unanswered
      }
      asio::co_spawn(ioc_, session(std::make_shared<Conn>(std::move(socket), open_)),
                     asio::detached);
    }
  }

 private:
  awaitable<void> session(std::shared_ptr<Conn> c) {
    while (true) {
      Parser parser;
      // The header first; the body is read only once the header passed authentication, so no
      // limit while the header is read (check_header applies it). Not boost::none: Beast
      // compares the Content-Length with the optional limit, and an empty optional is below
      // every length, so every body would be refused.
      parser.body_limit(std::numeric_limits<std::uint64_t>::max());
      beast::error_code ec;
      c->stream.expires_after(timeout_keep_alive_);  // idle keep-alive, slow headers
      co_await http::async_read_header(c->stream, c->buffer, parser,
                                       asio::redirect_error(use_awaitable, ec));
      if (ec == http::error::end_of_stream || ec == asio::error::eof ||
          ec == beast::error::timeout || ec == asio::error::connection_reset) {
        break;
      }
      c->stream.expires_never();
      if (ec) {
        // Malformed HTTP or a header over Beast's limit: say so and close.
        const ApiError e = api_error(ec == http::error::header_limit ? 431 : 400,
                                     "malformed HTTP request: " + ec.message(), "BadRequestError");
        co_await send_error(c, e, false);
        co_await linger_close(c);
        co_return;
      }
      const auto& head = parser.get();
      const bool keep_alive = head.keep_alive();
      std::string target(head.target());
      if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
      const Route route = route_of(target);
      // Answered from the header: the body, if any, is never read, and the connection closes.
      const bool unread_body = !parser.is_done();
      std::optional<ApiError> refused = check_header(parser, route, target);
      if (refused || route == Route::kHealth || route == Route::kVersion ||
          route == Route::kMetrics || route == Route::kModels) {
        const bool stay = keep_alive && !unread_body;
        const bool open =
            refused ? co_await send_error(c, *refused, stay) : co_await answer_get(c, route, stay);
        if (unread_body) {
          co_await linger_close(c);
          co_return;
        }
        if (!open || !stay) break;
        continue;
      }
      // An authenticated POST: now its body, up to --max-request-bytes.
      if (beast::iequals(head[http::field::expect], "100-continue")) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        c->stream.expires_after(std::chrono::seconds(10));
        co_await asio::async_write(c->stream, asio::buffer(kContinue),
                                   asio::redirect_error(use_awaitable, ec));
        if (ec) break;
      }
      parser.body_limit(max_request_bytes_);
      while (!ec && !parser.is_done()) {
        c->stream.expires_after(kBodyReadGap);
        co_await http::async_read_some(c->stream, c->buffer, parser,
                                       asio::redirect_error(use_awaitable, ec));
      }
      c->stream.expires_never();
      if (ec == http::error::end_of_stream || ec == asio::error::eof ||
          ec == beast::error::timeout || ec == asio::error::connection_reset) {
        break;
      }
      if (ec) {
        const bool too_large = ec == http::error::body_limit;
        const ApiError e = too_large ? body_too_large(std::nullopt)
                                     : api_error(400, "malformed HTTP request: " + ec.message(),
                                                 "BadRequestError");
        co_await send_error(c, e, false);
        co_await linger_close(c);
        co_return;
      }
      Request req = parser.release();
      const bool open = co_await answer_post(c, route, req, keep_alive);
      if (!open || !keep_alive) break;
    }
    beast::error_code ignored;
    c->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  }

  ApiError body_too_large(std::optional<uint64_t> size) const {
    return api_error(
        413,
        "the request body" + (size ? " (" + std::to_string(*size) + " bytes)" : std::string()) +
            " is over this server's limit of " + std::to_string(max_request_bytes_) + " bytes",
        "RequestTooLarge");
  }

  // The answer a request gets from its header alone, if any: 404, 401, 405 or 413.
  std::optional<ApiError> check_header(const Parser& parser, Route route,
                                       const std::string& target) const {
    const auto& head = parser.get();
    const bool get = head.method() == http::verb::get;
    const bool post = head.method() == http::verb::post;
    if (route == Route::kNone || (is_open_route(route) && !get)) {
      return api_error(404, "no route " + target, "NotFoundError");
    }
    if (is_open_route(route)) return std::nullopt;
    if (!authorized(head)) {
      return api_error(401, "Unauthorized: send 'Authorization: Bearer <the server's --api-key>'",
                       "AuthenticationError");
    }
    if (route == Route::kModels ? !get : !post) {
      return api_error(405, "method not allowed", "MethodNotAllowed");
    }
    if (auto size = parser.content_length(); size && *size > max_request_bytes_) {
      return body_too_large(std::optional<uint64_t>(*size));
    }
    return std::nullopt;
  }

  // Ends a connection whose request body was not read (kLingerTime says why).
  awaitable<void> linger_close(std::shared_ptr<Conn> c) {
    beast::error_code ec;
    c->stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    c->buffer.clear();
    c->buffer.shrink_to_fit();
    c->stream.expires_after(kLingerTime);
    size_t discarded = 0;
    while (!ec && discarded < kLingerBytes) {
      discarded += co_await c->stream.async_read_some(asio::buffer(sink_),
                                                      asio::redirect_error(use_awaitable, ec));
    }
    c->stream.socket().close(ec);
  }

  // Over --max-connections: a 503 and close.
  awaitable<void> refuse(std::shared_ptr<Conn> c) {
    const ApiError e =
        api_error(503,
                  "the server has its maximum of " + std::to_string(max_connections_) +
                      " connections open (--max-connections); retry later",
                  "ServiceUnavailableError");
    co_await send_error(c, e, false);
    co_await linger_close(c);
  }

  awaitable<bool> send(std::shared_ptr<Conn> c, http::status status, std::string body,
                       const char* content_type, bool keep_alive) {
    http::response<http::string_body> res{status, 11};
    res.set(http::field::server, "tessera");
    res.set(http::field::content_type, content_type);
    res.keep_alive(keep_alive);
    res.body() = std::move(body);
    res.prepare_payload();
    metrics_.http_responses[static_cast<int>(status)]++;
    beast::error_code ec;
    c->stream.expires_after(std::chrono::seconds(60));
    co_await http::async_write(c->stream, res, asio::redirect_error(use_awaitable, ec));
    c->stream.expires_never();
    co_return !ec;
  }

  awaitable<bool> send_json(std::shared_ptr<Conn> c, const json& body, bool keep_alive) {
    co_return co_await send(c, http::status::ok, body.dump(), "application/json", keep_alive);
  }

  awaitable<bool> send_error(std::shared_ptr<Conn> c, const ApiError& e, bool keep_alive) {
    co_return co_await send(c, static_cast<http::status>(e.status), error_body(e),
                            "application/json", keep_alive);
  }

  template <typename Head>
  bool authorized(const Head& req) const {
    if (api_key_.empty()) return true;
    auto it = req.find(http::field::authorization);
    if (it == req.end()) return false;
    const std::string want = "Bearer " + api_key_;
    const auto got = it->value();
    if (got.size() != want.size()) return false;
    unsigned diff = 0;  // constant time
    for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned>(got[i] ^ want[i]);
    return diff == 0;
  }

  // GET /health, /version, /metrics, /v1/models (checked by check_header).
  awaitable<bool> answer_get(std::shared_ptr<Conn> c, Route route, bool keep_alive) {
    switch (route) {
      case Route::kHealth:
        if (engine_.healthy()) {
          co_return co_await send(c, http::status::ok, "", "text/plain", keep_alive);
        }
        co_return co_await send_error(
            c,
            api_error(503, "unhealthy: " + engine_.unhealthy_reason(), "ServiceUnavailableError"),
            keep_alive);
      case Route::kVersion: {
        json version;
        version["version"] = std::string(TESSERA_VERSION);
        co_return co_await send_json(c, version, keep_alive);
      }
      case Route::kMetrics:
        co_return co_await send(
            c, http::status::ok,
            prometheus(metrics_, engine_.stats(), model_.names.front()) +
                replica_prometheus(engine_.data_parallel(), engine_.replicas(),
                                   engine_.routing_times(), model_.names.front()),
            "text/plain; version=0.0.4", keep_alive);
      default:
        co_return co_await send_json(c, models_response(model_), keep_alive);
    }
  }

  // An authenticated POST with its body: parsed and tokenized on a worker, then answered or run.
  awaitable<bool> answer_post(std::shared_ptr<Conn> c, Route route, const Request& req,
                              bool keep_alive) {
    const auto arrived = Clock::now();
    Prepared p = co_await asio::co_spawn(
        workers_,
        [this, route, &req]() -> awaitable<Prepared> { co_return prepare(route, req.body()); },
        use_awaitable);
    if (p.error) co_return co_await send_error(c, *p.error, keep_alive);
    if (route == Route::kTokenize || route == Route::kDetokenize) {
      co_return co_await send(c, http::status::ok, std::move(p.response), "application/json",
                              keep_alive);
    }
    co_return co_await complete(c, std::move(p.request), route == Route::kGenerate, keep_alive,
                                arrived);
  }

  // On a worker: the JSON body parsed, the chat template rendered, the prompts tokenized. Reads
  // only model_ (immutable; the Tokenizer and ChatTemplate are safe on many threads at once).
  Prepared prepare(Route route, const std::string& text) const {
    Prepared p;
    try {
      // Ordered: the chat template shows the keys of messages and tools in the client's order.
      ordered_json body = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (body.is_discarded()) {
        p.error = bad_request("the request body is not valid JSON");
      } else if (route == Route::kTokenize) {
        tokenize(body, p);
      } else if (route == Route::kDetokenize) {
        detokenize(body, p);
      } else {
        p.error = parse_request(body, route == Route::kChat, model_, p.request);
      }
    } catch (const std::exception& e) {
      p.error = bad_request(std::string("the request could not be parsed: ") + e.what());
    }
    return p;
  }

  json tokens_json(const std::vector<int32_t>& ids) const {
    return {{"count", ids.size()}, {"max_model_len", model_.info.max_model_len}, {"tokens", ids}};
  }

  void tokenize(const ordered_json& body, Prepared& p) const {
    ApiRequest parsed;
    const bool chat = body.is_object() && body.contains("messages");
    ordered_json as_request = body;
    if (as_request.is_object()) {
      as_request.erase("max_tokens");
      if (!chat) {
        // add_special_tokens (default true) decides the BOS; parse_request always adds them.
        const bool add = body.value("add_special_tokens", true);
        if (!add && body.contains("prompt") && body["prompt"].is_string()) {
          auto ids = model_.tokenizer->encode(body["prompt"].get<std::string>(), false);
          p.response = tokens_json(ids).dump();
          return;
        }
      }
      as_request["max_tokens"] = 1;
    }
    if (auto e = parse_request(as_request, chat, model_, parsed)) {
      p.error = std::move(e);
      return;
    }
    p.response = tokens_json(parsed.requests.front().prompt()).dump();
  }

  void detokenize(const ordered_json& body, Prepared& p) const {
    if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
      p.error = bad_request("tokens must be a list of token ids", "tokens");
      return;
    }
    std::vector<int32_t> ids;
    for (const auto& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
          t.get<int64_t>() >= model_.info.vocab_size) {
        p.error = bad_request(
            "tokens must be ids in [0, " + std::to_string(model_.info.vocab_size) + ")", "tokens");
        return;
      }
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    p.response = json{{"prompt", model_.tokenizer->decode(ids, false)}}.dump();
  }

  // Watches the socket while a request runs: a client that closes it aborts the request.
  static awaitable<void> watch(std::shared_ptr<Conn> c, std::shared_ptr<Pending> p) {
    beast::error_code ec;
    co_await c->stream.socket().async_wait(tcp::socket::wait_read,
                                           asio::redirect_error(use_awaitable, ec));
    if (ec) co_return;  // cancelled: the request finished
    char byte;
    const ssize_t n = ::recv(c->stream.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      p->disconnected = true;
      p->timer.cancel();
    }
    // n > 0: the client pipelined its next request; it is still there.
  }

  // One completion request while it runs (I/O thread): its choices on the engine, their results
  // so far, and the writer of its answer (both borrow `req`: a Completion stays where it is).
  struct Completion {
    explicit Completion(ApiRequest r, Clock::time_point arrived)
        : req(std::move(r)), results(req, arrived) {}
    ApiRequest req;
    ChoiceResults results;
    std::string id;
    std::unique_ptr<ResponseWriter> writer;
    std::shared_ptr<Pending> pending;
    std::vector<uint64_t> ids;  // the engine's, by choice
    bool open = true;           // the streamed answer can still be written
  };

  // Runs a parsed request on the engine and sends its answer (whole, or as a stream): its
  // choices are added, their outputs pumped to the writer until all finished, and the answer
  // finished. False when the connection cannot go on.
  awaitable<bool> complete(std::shared_ptr<Conn> c, ApiRequest req, bool legacy, bool keep_alive,
                           Clock::time_point arrived) {
    Completion run(std::move(req), arrived);
    run.id = random_id(run.req.chat ? "chatcmpl-" : "cmpl-");
    run.writer = make_response_writer(run.req, legacy, run.id, unix_now(), model_);
    if (Status added = add(run); !added) {
      co_return co_await send_error(c, bad_request(added.message()), keep_alive);
    }
    asio::co_spawn(ioc_, watch(c, run.pending), asio::detached);
    co_await pump(c, run, keep_alive);
    co_return co_await finish(c, run, keep_alive);
  }

  // Queues each choice (each prompt's Request n times, the seed stepped per sample) on the
  // engine, its outputs to run.pending. A refusal (the engine shutting down) leaves none of them
  // queued.
  Status add(Completion& run) {
    const ApiRequest& req = run.req;
    const size_t n = static_cast<size_t>(req.n);
    run.pending = std::make_shared<Pending>(ioc_.get_executor());
    for (size_t i = 0; i < run.results.size(); ++i) {
      tessera::Request r = req.requests[i / n];  // (Request alone is the HTTP request here)
      if (req.sampling.seed && req.n > 1) r = r.with_seed(*req.sampling.seed + i % n);
      auto added = engine_.add(std::move(r), sink(run.pending, i));
      if (!added) {
        abort_unfinished(run);
        return added.status();
      }
      run.ids.push_back(*added);
    }
    return Status::ok();
  }

  // Hands the outputs of choice `index` from the engine thread to the I/O thread.
  AsyncEngine::Sink sink(std::shared_ptr<Pending> p, size_t index) {
    auto ex = ioc_.get_executor();
    return [p, index, ex](RequestOutput out) {
      {
        std::lock_guard<std::mutex> lock(p->mu);
        p->outputs.emplace_back(static_cast<int>(index), std::move(out));
      }
      asio::post(ex, [p]() { p->timer.cancel(); });
    };
  }

  void abort_unfinished(const Completion& run) {
    for (size_t i = 0; i < run.ids.size(); ++i) {
      if (!run.results.finished(i)) engine_.abort(run.ids[i]);
    }
  }

  // Takes the choices' outputs as they come until every choice finished, the client went away
  // or the stream broke; a streamed answer sends the writer's chunk for each (none after a
  // choice failed).
  awaitable<void> pump(std::shared_ptr<Conn> c, Completion& run, bool keep_alive) {
    Pending& p = *run.pending;
    if (run.req.stream) {
      run.open = co_await write_stream_head(c, run.writer->stream_content_type(), keep_alive);
    }
    while (!run.results.all_finished() && run.open && !p.disconnected) {
      std::deque<std::pair<int, RequestOutput>> batch;
      {
        std::lock_guard<std::mutex> lock(p.mu);
        batch.swap(p.outputs);
      }
      if (batch.empty()) {
        beast::error_code ec;
        p.timer.expires_at(Clock::time_point::max());
        co_await p.timer.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      for (auto& [index, out] : batch) {
        const size_t i = static_cast<size_t>(index);
        run.results.add(i, out, metrics_);
        if (!run.req.stream || !run.open || !run.results.error().empty()) continue;
        const std::string data = run.writer->on_output(i, out, run.results.results()[i]);
        if (!data.empty() && !co_await write_chunk(c, data)) run.open = false;
      }
    }
  }

  // Ends the answer: when the client went away or the stream broke, nothing (the choices still
  // running are aborted); else the body (a 500 when a choice failed) or the stream's end.
  awaitable<bool> finish(std::shared_ptr<Conn> c, Completion& run, bool keep_alive) {
    if (run.pending->disconnected || !run.open) {
      abort_unfinished(run);
      spdlog::info("{}: the client went away; aborted", run.id);
      co_return false;
    }
    beast::error_code ignored;
    c->stream.socket().cancel(ignored);  // ends watch()
    spdlog::info("{}: {}", run.id, run.results.summary());
    std::optional<ApiError> error;
    if (!run.results.error().empty()) {
      error = api_error(500, run.results.error(), "InternalServerError");
    }
    if (!run.req.stream) {
      if (error) co_return co_await send_error(c, *error, keep_alive);
      const json body = run.writer->body(run.results.results());
      co_return co_await send_json(c, body, keep_alive);
    }
    const std::vector<std::string> end = run.writer->stream_end(run.results.results(), error);
    for (const std::string& chunk : end) {
      if (!co_await write_chunk(c, chunk)) co_return false;
    }
    beast::error_code ec;
    co_await asio::async_write(c->stream, http::make_chunk_last(),
                               asio::redirect_error(use_awaitable, ec));
    co_return !ec;
  }

  // The header of a streamed (chunked) answer.
  awaitable<bool> write_stream_head(std::shared_ptr<Conn> c, const char* content_type,
                                    bool keep_alive) {
    http::response<http::empty_body> head{http::status::ok, 11};
    head.set(http::field::server, "tessera");
    head.set(http::field::content_type, content_type);
    head.set(http::field::cache_control, "no-cache");
    head.keep_alive(keep_alive);
    head.chunked(true);
    http::response_serializer<http::empty_body> sr(head);
    beast::error_code ec;
    co_await http::async_write_header(c->stream, sr, asio::redirect_error(use_awaitable, ec));
    metrics_.http_responses[200]++;
    co_return !ec;
  }

  // One chunk of a streamed answer.
  awaitable<bool> write_chunk(std::shared_ptr<Conn> c, const std::string& data) {
    beast::error_code ec;
    c->stream.expires_after(std::chrono::seconds(60));
    co_await asio::async_write(c->stream, http::make_chunk(asio::buffer(data)),
                               asio::redirect_error(use_awaitable, ec));
    c->stream.expires_never();
    co_return !ec;
  }

  asio::io_context& ioc_;
  ReplicaSet& engine_;
  const ServedModel model_;
  const std::string api_key_;
  const uint64_t max_request_bytes_;
  const size_t max_connections_;
  const Clock::duration timeout_keep_alive_;
  Metrics metrics_;
  // Connections open (sessions) and being refused; I/O thread only.
  std::shared_ptr<size_t> open_ = std::make_shared<size_t>(0);
  std::shared_ptr<size_t> refusing_ = std::make_shared<size_t>(0);
  Throttle accept_log_{kAcceptLogEvery};
  Throttle refuse_log_{kAcceptLogEvery};
  std::array<char, 16384> sink_{};  // what lingering connections discard; I/O thread only
  asio::thread_pool workers_;       // request parsing and tokenization
};

}  // namespace

// How long SIGTERM may take to end the server (Kubernetes gives 30 s, Docker 10 s).
constexpr std::chrono::seconds kStopGrace{8};

namespace {

// The chat template (driver/chat_setup.h), with a warning when the model has none.
Expected<std::optional<chat::ChatTemplate>> load_chat_template(const ServeOptions& o,
                                                               const Tokenizer& tokenizer) {
  auto loaded = tessera::load_chat_template(o.chat_template, o.engine.model, tokenizer);
  if (loaded && !*loaded) {
    spdlog::warn(
        "the model has no chat template: /v1/chat/completions answers 400 (give one with "
        "--chat-template)");
  }
  return loaded;
}

}  // namespace

int serve_command(const ServeOptions& options) {
  auto fail = [](const Status& st) {
    std::cerr << "tessera serve: " << st.message() << "\n";
    return 1;
  };
  ServeOptions o = options;
  if (o.api_key.empty()) {
    if (const char* env = std::getenv("TESSERA_API_KEY")) o.api_key = env;
  }
  if (o.generation_config != "auto" && o.generation_config != "vllm") {
    return fail(invalid_argument("--generation-config '" + o.generation_config +
                                 "' is not one of auto, vllm"));
  }
  if (Status st = validate(o.engine); !st) return fail(st);
  if (o.enable_auto_tool_choice != !o.tool_call_parser.empty()) {
    return fail(
        invalid_argument("--enable-auto-tool-choice and --tool-call-parser go together (e.g. "
                         "--enable-auto-tool-choice --tool-call-parser hermes)"));
  }
  if (!o.tool_call_parser.empty() && o.tool_call_parser != "hermes") {
    return fail(invalid_argument("--tool-call-parser '" + o.tool_call_parser +
                                 "' is not one Tessera has: hermes"));
  }

  if (o.max_connections < 1) {
    return fail(invalid_argument("--max-connections must be at least 1, got " +
                                 std::to_string(o.max_connections)));
  }
  if (!(o.timeout_keep_alive > 0 && o.timeout_keep_alive <= 86400)) {
    return fail(invalid_argument("--timeout-keep-alive must be in (0, 86400] seconds, got " +
                                 std::to_string(o.timeout_keep_alive)));
  }
  fit_descriptor_limit(o.max_connections);

  // The port first: a busy one fails before a model loads for minutes.
  asio::io_context ioc(1);
  tcp::acceptor acceptor(ioc);
  {
    beast::error_code ec;
    auto address = asio::ip::make_address(o.host, ec);
    if (ec) return fail(invalid_argument("--host '" + o.host + "' is not an IP address"));
    tcp::endpoint endpoint(address, o.port);
    acceptor.open(endpoint.protocol(), ec);
    // Close-on-exec before the local node is forked: it and its actors must not hold the port.
    if (!ec) set_cloexec(acceptor.native_handle());
    if (!ec) acceptor.non_blocking(true, ec);  // accept4 after a readiness wait never blocks
    if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (ec) {
      return fail(unavailable("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " +
                              ec.message() + " (another server there? --port picks another)"));
    }
  }

  auto engine = ReplicaSet::start(o.engine, o.replicas, "tessera serve");
  if (!engine) return fail(engine.status());
  const ModelSession& session = (*engine)->session();

  ServedModel model;
  model.names =
      o.served_model_name.empty() ? std::vector<std::string>{o.engine.model} : o.served_model_name;
  model.root = o.engine.model;
  model.info = (*engine)->loaded();
  if (o.generation_config == "auto") model.defaults = session.defaults();
  model.tokenizer = &session.tokenizer();
  model.created = unix_now();
  model.tool_call_parser = o.tool_call_parser;
  auto chat_template = load_chat_template(o, session.tokenizer());
  if (!chat_template) return fail(chat_template.status());
  if (*chat_template) model.chat_template = &**chat_template;

  beast::error_code ec;
  acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail(unavailable("cannot listen: " + ec.message()));
  Server server(ioc, **engine, model, o);
  asio::signal_set signals(ioc, SIGINT, SIGTERM);
  signals.async_wait([&](const beast::error_code& e, int sig) {
    if (e) return;
    spdlog::info("{}: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    beast::error_code ignored;
    acceptor.close(ignored);
    ioc.stop();
  });
  asio::co_spawn(ioc, server.accept_loop(acceptor), asio::detached);
  const auto endpoint = acceptor.local_endpoint(ec);
  {
    const ModelInfo& m = (*engine)->loaded();
    const int64_t kv_tokens = m.kv_blocks * m.block_size;
    spdlog::info(
        "model: {} in {} on the {} backend{}{}, {} rank(s); weights {:.2f} GiB ({}), KV cache "
        "{:.2f} "
        "GiB = {} blocks of {} tokens = {} tokens ({:.1f} sequences of --max-model-len {}); "
        "loaded in {:.1f} s",
        m.architecture, m.dtype, m.backend, m.device_name.empty() ? "" : " on ", m.device_name,
        session.plan().plan.world, static_cast<double>(m.weight_bytes) / (1 << 30), m.quantization,
        static_cast<double>(m.kv_cache_bytes) / (1 << 30), m.kv_blocks, m.block_size, kv_tokens,
        m.max_model_len > 0 ? static_cast<double>(kv_tokens) / static_cast<double>(m.max_model_len)
                            : 0.0,
        m.max_model_len, (*engine)->load_seconds());
  }
  spdlog::info(
      "API server on http://{}:{} serving {} as '{}' (/v1/completions, /v1/chat/completions, "
      "/v1/models, /health, /metrics; {})",
      o.host, endpoint.port(), o.engine.model, model.names.front(),
      o.api_key.empty() ? "no API key" : "API key required");
  // Tests and scripts wait for this line on stdout.
  std::cout << "tessera serve: ready on http://" << o.host << ":" << endpoint.port() << std::endl;
  ioc.run();
  // Stopping is bounded whatever the engine thread is doing (a restart loading weights, a step
  // on a stuck group): past the grace the process exits, and what it started goes with it (the
  // local node by PR_SET_PDEATHSIG, a cluster's actors when their leases' connection closes).
  auto stopped = std::make_shared<std::promise<void>>();
  std::thread watchdog([finished = stopped->get_future()]() mutable {
    if (finished.wait_for(kStopGrace) == std::future_status::timeout) {
      spdlog::error(
          "stopping took longer than {} s: exiting now; the daemons stop this server's "
          "actors",
          std::chrono::duration_cast<std::chrono::seconds>(kStopGrace).count());
      std::_Exit(1);
    }
  });
  server.stop_workers();  // they read the tokenizer, which goes with the engine
  engine->reset();        // unfinished requests end, the actors stop
  stopped->set_value();
  watchdog.join();
  return 0;
}

}  // namespace tessera::server
