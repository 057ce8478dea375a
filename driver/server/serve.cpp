#include "driver/server/serve.h"

#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <CLI/CLI.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

#include "common/tokenizer/tokenizer.h"
#include "driver/chat/chat_template.h"
#include "driver/server/async_engine.h"
#include "driver/server/metrics.h"
#include "driver/server/openai_api.h"
#include "driver/server/tool_parser.h"

namespace tessera::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using asio::awaitable;
using asio::use_awaitable;
using nlohmann::json;
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
  cmd->footer("Example: tessera serve /models/Llama-3.1-8B-Instruct -tp 2 --port 8000");
  return cmd;
}

std::vector<std::string> serve_positional_model(std::vector<std::string> args) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "serve") {
      const std::string& next = args[i + 1];
      if (!next.empty() && next[0] != '-') args.insert(args.begin() + i + 1, "--model");
      break;
    }
    if (!args[i].empty() && args[i][0] != '-' && i > 0) break;  // another subcommand
  }
  return args;
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

struct Conn {
  explicit Conn(tcp::socket s) : stream(std::move(s)) {}
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
};

using Request = http::request<http::string_body>;

class Server {
 public:
  Server(asio::io_context& ioc, AsyncEngine& engine, ServedModel model, std::string api_key,
         uint64_t max_request_bytes)
      : ioc_(ioc),
        engine_(engine),
        model_(std::move(model)),
        api_key_(std::move(api_key)),
        max_request_bytes_(max_request_bytes) {}

  awaitable<void> accept_loop(tcp::acceptor& acceptor) {
    while (acceptor.is_open()) {
      beast::error_code ec;
      tcp::socket socket = co_await acceptor.async_accept(asio::redirect_error(use_awaitable, ec));
      if (ec) {
        if (ec == asio::error::operation_aborted || !acceptor.is_open()) co_return;
        spdlog::warn("accept failed: {}; still serving", ec.message());
        asio::steady_timer pause(ioc_, std::chrono::milliseconds(50));  // EMFILE: back off
        co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      asio::co_spawn(ioc_, session(std::make_shared<Conn>(std::move(socket))), asio::detached);
    }
  }

 private:
  awaitable<void> session(std::shared_ptr<Conn> c) {
    while (true) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(max_request_bytes_);
      beast::error_code ec;
      c->stream.expires_after(std::chrono::seconds(300));  // idle keep-alive connections end
      co_await http::async_read(c->stream, c->buffer, parser,
                                asio::redirect_error(use_awaitable, ec));
      if (ec == http::error::end_of_stream || ec == asio::error::eof ||
          ec == beast::error::timeout || ec == asio::error::connection_reset) {
        break;
      }
      if (ec) {
        // Malformed HTTP or a body over the limit: say so and close.
        const int status = ec == http::error::body_limit ? 413 : 400;
        const ApiError e = api_error(status, "malformed HTTP request: " + ec.message(),
                                     status == 413 ? "RequestTooLarge" : "BadRequestError");
        co_await send_error(c, e, false);
        break;
      }
      c->stream.expires_never();
      Request req = parser.release();
      const bool keep_alive = req.keep_alive();
      const bool open = co_await route(c, req, keep_alive);
      if (!open || !keep_alive) break;
    }
    beast::error_code ignored;
    c->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
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

  bool authorized(const Request& req) const {
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

  awaitable<bool> route(std::shared_ptr<Conn> c, Request& req, bool keep_alive) {
    std::string target(req.target());
    if (auto q = target.find('?'); q != std::string::npos) target.resize(q);
    const bool get = req.method() == http::verb::get;
    const bool post = req.method() == http::verb::post;
    if (target == "/health" && get) {
      if (engine_.healthy()) {
        co_return co_await send(c, http::status::ok, "", "text/plain", keep_alive);
      }
      const ApiError e =
          api_error(503, "unhealthy: " + engine_.unhealthy_reason(), "ServiceUnavailableError");
      co_return co_await send_error(c, e, keep_alive);
    }
    if (target == "/version" && get) {
      const json version = {{"version", std::string(TESSERA_VERSION)}};
      co_return co_await send_json(c, version, keep_alive);
    }
    if (target == "/metrics" && get) {
      co_return co_await send(c, http::status::ok,
                              prometheus(metrics_, engine_.stats(), model_.names.front()),
                              "text/plain; version=0.0.4", keep_alive);
    }
    const bool known = target == "/v1/models" || target == "/v1/completions" ||
                       target == "/v1/chat/completions" || target == "/tokenize" ||
                       target == "/detokenize" || target == "/generate";
    if (!known) {
      const ApiError e = api_error(404, "no route " + target, "NotFoundError");
      co_return co_await send_error(c, e, keep_alive);
    }
    if (!authorized(req)) {
      const ApiError e =
          api_error(401, "Unauthorized: send 'Authorization: Bearer <the server's --api-key>'",
                    "AuthenticationError");
      co_return co_await send_error(c, e, keep_alive);
    }
    if (target == "/v1/models") {
      if (!get) co_return co_await method_not_allowed(c, keep_alive);
      co_return co_await send_json(c, models_response(model_), keep_alive);
    }
    if (!post) co_return co_await method_not_allowed(c, keep_alive);
    json body = json::parse(req.body(), nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded()) {
      co_return co_await send_error(c, bad_request("the request body is not valid JSON"),
                                    keep_alive);
    }
    if (target == "/tokenize") co_return co_await tokenize(c, body, keep_alive);
    if (target == "/detokenize") co_return co_await detokenize(c, body, keep_alive);
    const bool chat = target == "/v1/chat/completions";
    co_return co_await complete(c, body, chat, target == "/generate", keep_alive);
  }

  json tokens_json(const std::vector<int32_t>& ids) const {
    return {{"count", ids.size()}, {"max_model_len", model_.max_model_len}, {"tokens", ids}};
  }

  awaitable<bool> method_not_allowed(std::shared_ptr<Conn> c, bool keep_alive) {
    const ApiError e = api_error(405, "method not allowed", "MethodNotAllowed");
    co_return co_await send_error(c, e, keep_alive);
  }

  awaitable<bool> tokenize(std::shared_ptr<Conn> c, const json& body, bool keep_alive) {
    ApiRequest parsed;
    const bool chat = body.is_object() && body.contains("messages");
    json as_request = body;
    if (as_request.is_object()) {
      as_request.erase("max_tokens");
      if (!chat) {
        // add_special_tokens (default true) decides the BOS; parse_request always adds them.
        const bool add = body.value("add_special_tokens", true);
        if (!add && body.contains("prompt") && body["prompt"].is_string()) {
          auto ids = model_.tokenizer->encode(body["prompt"].get<std::string>(), false);
          const json out = tokens_json(ids);
          co_return co_await send_json(c, out, keep_alive);
        }
      }
      as_request["max_tokens"] = 1;
    }
    if (auto e = parse_request(as_request, chat, model_, parsed)) {
      co_return co_await send_error(c, *e, keep_alive);
    }
    const auto& ids = parsed.prompts.front();
    const json out = tokens_json(ids);
    co_return co_await send_json(c, out, keep_alive);
  }

  awaitable<bool> detokenize(std::shared_ptr<Conn> c, const json& body, bool keep_alive) {
    if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
      co_return co_await send_error(c, bad_request("tokens must be a list of token ids", "tokens"),
                                    keep_alive);
    }
    std::vector<int32_t> ids;
    for (const auto& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model_.vocab_size) {
        co_return co_await send_error(
            c,
            bad_request("tokens must be ids in [0, " + std::to_string(model_.vocab_size) + ")",
                        "tokens"),
            keep_alive);
      }
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    const json out = {{"prompt", model_.tokenizer->decode(ids, false)}};
    co_return co_await send_json(c, out, keep_alive);
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

  awaitable<bool> complete(std::shared_ptr<Conn> c, const json& body, bool chat, bool legacy,
                           bool keep_alive) {
    const auto arrived = Clock::now();
    ApiRequest req;
    if (auto e = parse_request(body, chat, model_, req)) {
      co_return co_await send_error(c, *e, keep_alive);
    }
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = unix_now();
    auto p = std::make_shared<Pending>(ioc_.get_executor());
    const size_t choices = req.prompts.size() * static_cast<size_t>(req.n);
    std::vector<uint64_t> ids;
    std::vector<bool> done(choices, false);
    auto abort_all = [&]() {
      for (size_t i = 0; i < ids.size(); ++i) {
        if (!done[i]) engine_.abort(ids[i]);
      }
    };
    for (size_t i = 0; i < choices; ++i) {
      SamplingParams s = req.sampling;
      if (s.seed && req.n > 1) *s.seed += i % static_cast<size_t>(req.n);
      auto ex = ioc_.get_executor();
      auto added = engine_.add(req.prompts[i / static_cast<size_t>(req.n)], s,
                               [p, i, ex](RequestOutput out) {
                                 {
                                   std::lock_guard<std::mutex> lock(p->mu);
                                   p->outputs.emplace_back(static_cast<int>(i), std::move(out));
                                 }
                                 asio::post(ex, [p]() { p->timer.cancel(); });
                               });
      if (!added) {
        abort_all();
        co_return co_await send_error(c, bad_request(added.status().message()), keep_alive);
      }
      ids.push_back(*added);
    }
    asio::co_spawn(ioc_, watch(c, p), asio::detached);

    std::vector<ChoiceResult> results(choices);
    std::vector<HermesStream> tool_streams(req.parse_tools ? choices : 0);
    std::vector<bool> started(choices, false);
    std::vector<Clock::time_point> last(choices, arrived);
    std::string error;
    size_t finished = 0;
    bool open = true;
    if (req.stream) {
      http::response<http::empty_body> head{http::status::ok, 11};
      head.set(http::field::server, "tessera");
      head.set(http::field::content_type,
               legacy ? "application/json" : "text/event-stream; charset=utf-8");
      head.set(http::field::cache_control, "no-cache");
      head.keep_alive(keep_alive);
      head.chunked(true);
      http::response_serializer<http::empty_body> sr(head);
      beast::error_code ec;
      co_await http::async_write_header(c->stream, sr, asio::redirect_error(use_awaitable, ec));
      metrics_.http_responses[200]++;
      if (ec) open = false;
    }
    auto write_chunk = [&](const std::string& data) -> awaitable<bool> {
      beast::error_code ec;
      c->stream.expires_after(std::chrono::seconds(60));
      co_await asio::async_write(c->stream, http::make_chunk(asio::buffer(data)),
                                 asio::redirect_error(use_awaitable, ec));
      c->stream.expires_never();
      co_return !ec;
    };
    while (finished < choices && open && !p->disconnected) {
      std::deque<std::pair<int, RequestOutput>> batch;
      {
        std::lock_guard<std::mutex> lock(p->mu);
        batch.swap(p->outputs);
      }
      if (batch.empty()) {
        beast::error_code ec;
        p->timer.expires_at(Clock::time_point::max());
        co_await p->timer.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      for (auto& [index, out] : batch) {
        ChoiceResult& r = results[static_cast<size_t>(index)];
        const auto now = Clock::now();
        if (!out.new_tokens.empty()) {
          if (r.tokens.empty()) {
            metrics_.ttft.observe(std::chrono::duration<double>(now - arrived).count());
          } else {
            const double gap = std::chrono::duration<double>(now - last[index]).count() /
                               static_cast<double>(out.new_tokens.size());
            for (size_t k = 0; k < out.new_tokens.size(); ++k) metrics_.itl.observe(gap);
          }
          last[index] = now;
        }
        r.text += out.delta;
        r.tokens.insert(r.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
        r.logprobs.insert(r.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
        r.prompt_tokens = out.prompt_tokens ? out.prompt_tokens : r.prompt_tokens;
        r.cached_tokens = std::max(r.cached_tokens, out.cached_tokens);
        if (out.finished) {
          done[static_cast<size_t>(index)] = true;
          finished++;
          r.finish_reason = out.finish_reason;
          r.prompt_tokens = req.prompts[static_cast<size_t>(index) / req.n].size();
          if (out.finish_reason.rfind("error: ", 0) == 0) {
            error = out.finish_reason.substr(7);
          } else {
            metrics_.finished[api_finish_reason(out.finish_reason)]++;
          }
          metrics_.e2e.observe(std::chrono::duration<double>(now - arrived).count());
        }
        if (req.stream && open && error.empty()) {
          std::string data;
          if (legacy) {
            const std::string& prompt = req.prompt_texts[static_cast<size_t>(index) / req.n];
            data = json{{"text", json::array({prompt + r.text})}}.dump() + std::string(1, '\0');
          } else if (req.parse_tools) {
            // Content as it comes, each tool call once it is complete.
            HermesStream& tools = tool_streams[static_cast<size_t>(index)];
            HermesStream::Delta d = tools.push(out.delta);
            if (out.finished) {
              HermesStream::Delta rest = tools.finish();
              d.content += rest.content;
            }
            const int before = tools.calls() - static_cast<int>(d.calls.size());
            if (!d.content.empty() || !started[index]) {
              data += sse_event(stream_chunk(req, id, index, d.content, out.new_logprobs, "",
                                             !started[index], created, model_)
                                    .dump());
            }
            if (!d.calls.empty()) {
              data += sse_event(tool_call_chunk(req, id, index, d.calls, before, created).dump());
            }
            if (out.finished) {
              const std::string reason =
                  tools.calls() > 0 ? std::string("tool_calls") : out.finish_reason;
              data += sse_event(
                  stream_chunk(req, id, index, "", {}, reason, false, created, model_).dump());
            }
          } else if (!out.delta.empty() || !out.new_logprobs.empty() || out.finished ||
                     (chat && !started[index])) {
            std::string text = out.delta;
            if (req.echo && !started[index]) {
              text = req.prompt_texts[static_cast<size_t>(index) / req.n] + text;
            }
            json chunk = stream_chunk(req, id, index, text, out.new_logprobs,
                                      out.finished ? out.finish_reason : "",
                                      chat && !started[index], created, model_);
            data = sse_event(chunk.dump());
          }
          started[index] = true;
          if (!data.empty() && !co_await write_chunk(data)) open = false;
        }
      }
    }
    if (p->disconnected || !open) {
      abort_all();
      spdlog::info("{}: the client went away; aborted", id);
      co_return false;
    }
    beast::error_code ignored;
    c->stream.socket().cancel(ignored);  // ends watch()
    size_t prompt_tokens = 0, completion_tokens = 0;
    for (size_t i = 0; i < choices; ++i) {
      completion_tokens += results[i].tokens.size();
      if (i % static_cast<size_t>(req.n) == 0) prompt_tokens += results[i].prompt_tokens;
    }
    spdlog::info("{}: {} choice(s), {} prompt + {} completion tokens in {:.3f} s{}", id, choices,
                 prompt_tokens, completion_tokens,
                 std::chrono::duration<double>(Clock::now() - arrived).count(),
                 error.empty() ? "" : "; failed: " + error);
    if (!req.stream) {
      if (!error.empty()) {
        const ApiError e = api_error(500, error, "InternalServerError");
        co_return co_await send_error(c, e, keep_alive);
      }
      if (legacy) {
        json texts = json::array();
        for (size_t i = 0; i < choices; ++i) {
          texts.push_back(req.prompt_texts[i / static_cast<size_t>(req.n)] + results[i].text);
        }
        const json out = {{"text", texts}};
        co_return co_await send_json(c, out, keep_alive);
      }
      co_return co_await send_json(c, completion_response(req, id, results, model_), keep_alive);
    }
    if (!error.empty()) {
      const ApiError e = api_error(500, error, "InternalServerError");
      if (!co_await write_chunk(sse_event(error_body(e)))) co_return false;
    }
    if (!legacy) {
      if (req.include_usage) {
        if (!co_await write_chunk(sse_event(usage_chunk(req, id, results, created).dump()))) {
          co_return false;
        }
      }
      if (!co_await write_chunk(sse_event("[DONE]"))) co_return false;
    }
    beast::error_code ec;
    co_await asio::async_write(c->stream, http::make_chunk_last(),
                               asio::redirect_error(use_awaitable, ec));
    co_return !ec;
  }

  asio::io_context& ioc_;
  AsyncEngine& engine_;
  ServedModel model_;
  std::string api_key_;
  uint64_t max_request_bytes_;
  Metrics metrics_;
};

Expected<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
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

  // The port first: a busy one fails before a model loads for minutes.
  asio::io_context ioc(1);
  tcp::acceptor acceptor(ioc);
  {
    beast::error_code ec;
    auto address = asio::ip::make_address(o.host, ec);
    if (ec) return fail(invalid_argument("--host '" + o.host + "' is not an IP address"));
    tcp::endpoint endpoint(address, o.port);
    acceptor.open(endpoint.protocol(), ec);
    if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (ec) {
      return fail(unavailable("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " +
                              ec.message() + " (another server there? --port picks another)"));
    }
  }

  auto engine = AsyncEngine::start(o.engine, "tessera serve");
  if (!engine) return fail(engine.status());
  const ModelSession& session = (*engine)->session();

  ServedModel model;
  model.names =
      o.served_model_name.empty() ? std::vector<std::string>{o.engine.model} : o.served_model_name;
  model.root = o.engine.model;
  model.max_model_len = (*engine)->loaded().max_model_len;
  model.vocab_size = (*engine)->loaded().vocab_size;
  if (o.generation_config == "auto") model.defaults = session.defaults();
  model.tokenizer = &session.tokenizer();
  model.created = unix_now();
  model.tool_call_parser = o.tool_call_parser;
  std::optional<chat::ChatTemplate> chat_template;
  if (!o.chat_template.empty()) {
    std::string source = o.chat_template;
    if (std::filesystem::is_regular_file(o.chat_template)) {
      auto text = read_text(o.chat_template);
      if (!text) return fail(text.status());
      source = *text;
    }
    auto bos = session.tokenizer().bos_id();
    auto eos = session.tokenizer().eos_ids();
    auto parsed = chat::ChatTemplate::parse(
        source, bos ? session.tokenizer().id_to_token(*bos).value_or("") : "",
        eos.empty() ? "" : session.tokenizer().id_to_token(eos.front()).value_or(""));
    if (!parsed) return fail(parsed.status().with_context("--chat-template"));
    chat_template = std::move(*parsed);
  } else {
    auto loaded = chat::ChatTemplate::load(o.engine.model + "/tokenizer_config.json");
    if (loaded) {
      chat_template = std::move(*loaded);
    } else if (loaded.status().code() == Code::kNotFound) {
      spdlog::warn(
          "the model has no chat template: /v1/chat/completions answers 400 (give one with "
          "--chat-template)");
    } else {
      return fail(loaded.status());
    }
  }
  if (chat_template) model.chat_template = &*chat_template;

  beast::error_code ec;
  acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail(unavailable("cannot listen: " + ec.message()));
  Server server(ioc, **engine, model, o.api_key, o.max_request_bytes);
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
        "model: {} in {} on the {} backend{}{}, {} rank(s); weights {:.2f} GiB, KV cache {:.2f} "
        "GiB = {} blocks of {} tokens = {} tokens ({:.1f} sequences of --max-model-len {}); "
        "loaded in {:.1f} s",
        m.architecture, m.dtype, m.backend, m.device_name.empty() ? "" : " on ", m.device_name,
        session.plan().plan.world, static_cast<double>(m.weight_bytes) / (1 << 30),
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
  engine->reset();  // unfinished requests end, the actors stop
  return 0;
}

}  // namespace tessera::server
