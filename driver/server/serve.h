// `tessera serve`: an OpenAI-compatible HTTP server over the asynchronous engine, with vLLM's
// flags, so that a vLLM command line works after changing the program name:
//
//   tessera serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--served-model-name NAME ...]
//                 [--api-key KEY] [-tp T] [-pp P] [--dtype D] [--max-model-len L] ...
//
// Endpoints: POST /v1/completions, /v1/chat/completions (JSON or SSE streams ending in
// "data: [DONE]"), GET /v1/models, /health, /version, /metrics (Prometheus, vLLM's metric
// names), POST /tokenize, /detokenize and vLLM's legacy /generate. HTTP/1.1 with keep-alive on
// Boost.Beast; C++20 coroutines on one I/O thread; request parsing, chat templates and
// tokenization on a small worker pool (a large prompt never stalls /health); the engine on its
// own thread (async_engine.h).
//
// Before a client is authenticated the server holds no more than a request header (Beast's
// 8 KiB limit): the Authorization header is checked before the body is read, and a request
// that fails it (or any answer that needs no body: 404, 405, 413) is answered from the header,
// after which the connection closes without reading the body. Open connections are capped
// (--max-connections; beyond it a connection is answered 503 and closed); a connection that is
// idle, or sends its header too slowly, is closed after --timeout-keep-alive seconds. The
// listening socket and accepted connections are close-on-exec: the local node and its actors
// never hold them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "driver/model_session.h"
#include "driver/server/replica_set.h"

namespace CLI {
class App;
}

namespace tessera::server {

struct ServeOptions {
  EngineArgs engine;
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::vector<std::string> served_model_name;  // default: the --model argument as given
  std::string api_key;                         // else $TESSERA_API_KEY; empty = no key
  std::string chat_template;  // a file, or the template itself; default: the tokenizer's
  std::string generation_config = "auto";  // auto: generation_config.json | vllm: none
  uint64_t max_request_bytes = 32ull << 20;
  // Open HTTP connections at most; a connection beyond it is answered 503 and closed.
  int max_connections = 1024;
  // Seconds a connection may be idle (keep-alive between requests) or take to send a request
  // header, as uvicorn's --timeout-keep-alive; then it is closed.
  double timeout_keep_alive = 5.0;
  bool enable_auto_tool_choice = false;  // with tool_call_parser: tool calls become tool_calls
  std::string tool_call_parser;          // hermes
  ReplicaOptions replicas;               // -dp, --router
};

// Adds `serve` with its flags to `app`.
CLI::App* add_serve_subcommand(CLI::App& app, ServeOptions& options);

// Runs until SIGINT or SIGTERM; returns the exit code (errors printed to stderr prefixed
// "tessera serve: ").
int serve_command(const ServeOptions& options);

}  // namespace tessera::server
