// `tessera serve` as users meet it: the real binary on a port, curl and the OpenAI SDK for
// Node.js as clients, a raw socket where a client misbehaves (malformed HTTP, a disconnect in
// the middle of a stream), and a SIGKILLed actor. The model is a tiny seeded llama whose greedy
// tokens transformers computed (tests/assets/goldens/model_llama.json).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/checkpoint/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::BackgroundProcess;
using testing::bin;
using testing::children_of;
using testing::CommandResult;
using testing::run_command;
using testing::wait_until;
using namespace std::chrono_literals;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

// A program on $PATH (curl, node), as a shell would find it.
std::string which(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return name;
}

// A TCP connection to 127.0.0.1:port, or -1.
int connect_local(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct Reply {
  int status = 0;
  std::string body;
  json j() const { return json::parse(body, nullptr, false); }
};

// A running server on a port of its own; `model` is vLLM's positional (empty: `extra` gives
// --model).
class Server {
 public:
  Server(const std::string& model, const std::string& root, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {bin("tessera"), "serve"};
    if (!model.empty()) argv.push_back(model);
    for (std::string a : {"--device", "cpu", "--port", "0", "--served-model-name", "tiny"}) {
      argv.push_back(a);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    process_ = std::make_unique<BackgroundProcess>(
        argv, std::vector<std::string>{"TESSERA_TMPDIR=" + root});
    wait_until(
        [&] {
          std::smatch m;
          const std::string out = process_->out();
          static const std::regex ready("ready on http://127\\.0\\.0\\.1:([0-9]+)");
          if (std::regex_search(out, m, ready)) port_ = std::stoi(m[1]);
          return port_ > 0 || process_->wait(0ms) != -1;
        },
        60s);
  }
  int port() const { return port_; }
  BackgroundProcess& process() { return *process_; }
  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }

  // curl, as a user would run it; `key` goes in the Authorization header when not empty.
  Reply call(const std::string& method, const std::string& path, const std::string& body = "",
             const std::string& key = "secret") const {
    std::vector<std::string> argv = {which("curl"), "-sS",           "-N", "-X", method,
                                     "-w",          "\n%{http_code}"};
    if (!key.empty()) argv.insert(argv.end(), {"-H", "Authorization: Bearer " + key});
    if (!body.empty())
      argv.insert(argv.end(), {"-H", "Content-Type: application/json", "-d", body});
    argv.push_back(url(path));
    CommandResult r = run_command(argv, 120s);
    Reply reply;
    const size_t nl = r.out.rfind('\n');
    if (nl == std::string::npos) return reply;
    reply.status = std::atoi(r.out.c_str() + nl + 1);
    reply.body = r.out.substr(0, nl);
    return reply;
  }
  Reply post(const std::string& path, const json& body, const std::string& key = "secret") const {
    return call("POST", path, body.dump(), key);
  }

  // A metric's value from /metrics (the first sample of that name).
  double metric(const std::string& name) const {
    Reply r = call("GET", "/metrics");
    std::istringstream lines(r.body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) {
        return std::stod(line.substr(line.rfind(' ') + 1));
      }
    }
    return -1;
  }

 private:
  std::unique_ptr<BackgroundProcess> process_;
  int port_ = -1;
};

// Client threads of a test against `server`: joined when the test leaves, early too (a failed
// ASSERT), after killing the server if it still runs so that they return; a thread left
// joinable would end the binary with std::terminate and leave the server running.
class Clients {
 public:
  explicit Clients(Server& server) : server_(server) {}
  ~Clients() {
    if (server_.process().wait(0ms) == -1) ::kill(server_.process().pid(), SIGKILL);
    join();
  }
  template <typename F>
  void spawn(F body) {
    threads_.emplace_back(std::move(body));
  }
  void join() {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  Server& server_;
  std::vector<std::thread> threads_;
};

// The text of an SSE stream's data events, the events themselves, and whether it ended in [DONE].
struct Sse {
  std::vector<json> events;
  bool done = false;
};
Sse parse_sse(const std::string& body) {
  Sse s;
  std::istringstream lines(body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      s.done = true;
    } else {
      s.events.push_back(json::parse(data, nullptr, false));
    }
  }
  return s;
}

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = (fs::temp_directory_path() / ("tessera-serve-" + std::to_string(::getpid()))).string();
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ifstream in(source("tests/assets/goldens/model_llama.json"));
    golden_ = json::parse(in);
    model_ = root_ + "/model";
    CommandResult r = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset",
                                   "tiny", "--tokenizer", source("tests/assets/tokenizers/llama3"),
                                   "--seed", std::to_string(golden_["seed"].get<int>()), "--dtype",
                                   "bf16", "--out", model_});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    server_ = new Server(
        model_, root_,
        {"--api-key", "secret", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"});
    ASSERT_GT(server_->port(), 0) << server_->process().err();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    fs::remove_all(root_);
  }

  static inline std::string root_, model_;
  static inline json golden_;
  static inline Server* server_ = nullptr;
};

TEST_F(ServeTest, GreedyCompletionsAreTransformersTokens) {
  for (const auto& c : golden_["cases"]) {
    std::vector<int> want = c["greedy"].get<std::vector<int>>();
    want.resize(12);
    Reply text = server_->post("/detokenize", {{"tokens", want}});
    ASSERT_EQ(text.status, 200) << text.body;
    // Token ids in, and the prompt as text (tokenized by the server) in: the same answer.
    for (const json& prompt : {c["ids"], c["prompt"]}) {
      Reply r = server_->post("/v1/completions", {{"model", "tiny"},
                                                  {"prompt", prompt},
                                                  {"max_tokens", 12},
                                                  {"temperature", 0},
                                                  {"ignore_eos", true}});
      ASSERT_EQ(r.status, 200) << r.body;
      json j = r.j();
      EXPECT_EQ(j["object"], "text_completion");
      EXPECT_EQ(j["model"], "tiny");
      EXPECT_EQ(j["choices"][0]["text"], text.j()["prompt"]) << c["prompt"];
      EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
      EXPECT_EQ(j["usage"]["prompt_tokens"], c["ids"].size());
      EXPECT_EQ(j["usage"]["completion_tokens"], 12);
    }
  }
}

TEST_F(ServeTest, AStreamAddsUpToTheAnswerAndEndsWithDone) {
  json body = {{"prompt", "The capital of France is"},
               {"max_tokens", 10},
               {"temperature", 0},
               {"ignore_eos", true},
               {"logprobs", 2}};
  Reply whole = server_->post("/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  Reply streamed = server_->post("/v1/completions", body);
  ASSERT_EQ(streamed.status, 200);
  Sse s = parse_sse(streamed.body);
  EXPECT_TRUE(s.done) << streamed.body;
  std::string text;
  size_t logprobs = 0;
  for (const json& e : s.events) {
    ASSERT_FALSE(e.is_discarded());
    if (e["choices"].empty()) continue;
    text += e["choices"][0]["text"].get<std::string>();
    if (e["choices"][0]["logprobs"].is_object()) {
      logprobs += e["choices"][0]["logprobs"]["tokens"].size();
    }
  }
  EXPECT_EQ(text, whole.j()["choices"][0]["text"]);
  EXPECT_EQ(logprobs, 10u);
  ASSERT_FALSE(s.events.empty());
  EXPECT_EQ(s.events.back()["usage"]["completion_tokens"], 10);  // include_usage: last, alone
  EXPECT_TRUE(s.events.back()["choices"].empty());
  json lp = whole.j()["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"].size(), 10u);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
}

TEST_F(ServeTest, ChatRendersTheModelsTemplate) {
  json messages = json::array({{{"role", "system"}, {"content", "You are terse."}},
                               {{"role", "user"}, {"content", "Hello!"}}});
  Reply tokens = server_->post("/tokenize", {{"messages", messages}});
  ASSERT_EQ(tokens.status, 200) << tokens.body;
  Reply r = server_->post("/v1/chat/completions", {{"model", "tiny"},
                                                   {"messages", messages},
                                                   {"max_tokens", 5},
                                                   {"temperature", 0},
                                                   {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.j();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokens.j()["count"]);
  // The llama3 template starts with <|begin_of_text|> and ends with the assistant header.
  std::vector<int> ids = tokens.j()["tokens"].get<std::vector<int>>();
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 128000);
  Reply text = server_->post("/detokenize", {{"tokens", ids}});
  EXPECT_NE(
      text.j()["prompt"].get<std::string>().find("<|start_header_id|>assistant<|end_header_id|>"),
      std::string::npos)
      << text.body;
  // n = 2 with a seed: two choices, reproducible.
  json sampled = {
      {"messages", messages}, {"max_tokens", 6}, {"temperature", 1.0}, {"seed", 7}, {"n", 2},
      {"ignore_eos", true}};
  Reply a = server_->post("/v1/chat/completions", sampled);
  Reply b = server_->post("/v1/chat/completions", sampled);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(a.j()["choices"].size(), 2u);
  EXPECT_EQ(a.j()["choices"], b.j()["choices"]);
  EXPECT_EQ(a.j()["usage"]["completion_tokens"], 12);
}

TEST_F(ServeTest, BadRequestsAreOpenAIErrorsAndTheServerGoesOn) {
  struct Case {
    std::string method, path, body;
    int status;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"POST", "/v1/completions", "{not json", 400, "not valid JSON"},
      {"POST", "/v1/completions", R"({"max_tokens": 4})", 400, "prompt is required"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "temperature": "hot"})", 400,
       "temperature must be a number"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": 0})", 400,
       "max_tokens must be at least 1"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "max_tokens": 100000000})", 400,
       "maximum context length"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "top_p": 7})", 400, "top_p"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "logprobs": 50})", 400, "logprobs"},
      {"POST", "/v1/completions", R"({"prompt": [999999999]})", 400, "outside the vocabulary"},
      {"POST", "/v1/completions", R"({"prompt": []})", 400, "prompt"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "n": 0})", 400, "n must be"},
      {"POST", "/v1/completions", R"({"prompt": "hi", "model": "gpt-9"})", 404, "does not exist"},
      {"POST", "/v1/chat/completions", R"({"messages": []})", 400, "messages"},
      {"POST", "/v1/chat/completions", R"({"messages": [{"content": "x"}]})", 400, "role"},
      {"POST", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "only text"},
      {"GET", "/v1/completions", "", 405, "method not allowed"},
      {"GET", "/v1/nothing", "", 404, "no route"},
      {"POST", "/detokenize", R"({"tokens": [-1]})", 400, "tokens"},
  };
  for (const Case& c : cases) {
    Reply r = server_->call(c.method, c.path, c.body);
    EXPECT_EQ(r.status, c.status) << c.body << " -> " << r.body;
    json j = r.j();
    ASSERT_FALSE(j.is_discarded()) << r.body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(c.says), std::string::npos)
        << c.body << " -> " << r.body;
    EXPECT_EQ(j["error"]["code"], c.status);
  }
  // The API key: none, or a wrong one, is a 401; /health needs none.
  EXPECT_EQ(server_->call("GET", "/v1/models", "", "").status, 401);
  EXPECT_EQ(server_->call("GET", "/v1/models", "", "wrong").status, 401);
  EXPECT_EQ(server_->call("GET", "/health", "", "").status, 200);
  // Malformed HTTP on a raw socket: a 400, and the server goes on.
  const int fd = connect_local(server_->port());
  ASSERT_GE(fd, 0);
  const std::string junk = "GARBAGE / HTTP/9.9\r\nContent-Length: -5\r\n\r\n";
  ASSERT_EQ(::send(fd, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
  char buf[512] = {};
  const ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
  ::close(fd);
  EXPECT_GT(n, 0);
  EXPECT_NE(std::string(buf).find(" 400 "), std::string::npos) << buf;
  Reply ok = server_->post("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(server_->call("GET", "/version").j()["version"].is_string(), true);
}

TEST_F(ServeTest, ManyConcurrentStreamsGetWhatOneAtATimeGets) {
  const int n = 12;
  std::vector<std::string> alone(n), together(n);
  auto body = [](int i) {
    return json{{"prompt", "Request number " + std::to_string(i) + " says"},
                {"max_tokens", 8 + i % 5},
                {"temperature", 0},
                {"ignore_eos", true}};
  };
  for (int i = 0; i < n; ++i) {
    alone[i] = server_->post("/v1/completions", body(i)).j()["choices"][0]["text"];
  }
  std::vector<std::thread> clients;
  for (int i = 0; i < n; ++i) {
    clients.emplace_back([&, i] {
      json b = body(i);
      b["stream"] = true;
      Sse s = parse_sse(server_->post("/v1/completions", b).body);
      if (!s.done) return;
      for (const json& e : s.events) together[i] += e["choices"][0]["text"].get<std::string>();
    });
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < n; ++i) EXPECT_EQ(together[i], alone[i]) << "request " << i;
}

// Each replica's value of a per-replica metric (tessera:replica_..., -dp).
std::vector<double> replica_metric(const Server& server, const std::string& name, size_t n) {
  std::vector<double> out(n, -1);
  std::istringstream lines(server.call("GET", "/metrics").body);
  static const std::regex sample("\\{model_name=\"[^\"]*\",replica=\"([0-9]+)\"\\} (.*)");
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (line.rfind(name + "{", 0) != 0) continue;
    const std::string rest = line.substr(name.size());
    if (std::regex_match(rest, m, sample) && std::stoul(m[1]) < n) {
      out[std::stoul(m[1])] = std::stod(m[2]);
    }
  }
  return out;
}

// Two replicas behind one endpoint (-dp 2, CPU actors on the local node): the same answers as
// one, an idle-start burst spread (neither takes more than 60%), the repeats of a prefix routed
// to the replica that holds it (--router prefix), and round robin alternating.
TEST_F(ServeTest, TwoReplicasShareTheLoadAndKeepPrefixesTogether) {
  Server dp(model_, root_, {"-dp", "2", "--router", "prefix", "--max-model-len", "512"});
  ASSERT_GT(dp.port(), 0) << dp.process().err();
  EXPECT_NE(dp.process().err().find("2 replica(s) behind one endpoint, router prefix"),
            std::string::npos);
  auto body = [](const std::string& prompt) {
    return json{{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
  };
  // Same greedy answers as the single-replica server.
  for (const char* p : {"The capital of France is", "Once upon a time"}) {
    Reply one = server_->post("/v1/completions", body(p));
    Reply two = dp.post("/v1/completions", body(p), "");
    ASSERT_EQ(two.status, 200) << two.body;
    EXPECT_EQ(two.j()["choices"][0]["text"], one.j()["choices"][0]["text"]) << p;
  }
  // A burst of 20 distinct prompts at once.
  const std::vector<double> before = replica_metric(dp, "tessera:replica_requests_routed", 2);
  std::vector<std::thread> burst;
  std::vector<int> status(20, 0);
  for (int i = 0; i < 20; ++i) {
    burst.emplace_back([&, i] {
      status[i] = dp.post("/v1/completions",
                          body("Burst request " + std::to_string(i) + " asks about topic " +
                               std::to_string(i * 7)),
                          "")
                      .status;
    });
  }
  for (auto& t : burst) t.join();
  EXPECT_EQ(std::count(status.begin(), status.end(), 200), 20);
  const std::vector<double> after = replica_metric(dp, "tessera:replica_requests_routed", 2);
  const double a = after[0] - before[0], b = after[1] - before[1];
  EXPECT_EQ(a + b, 20);
  EXPECT_LE(std::max(a, b), 12) << a << " / " << b;
  // Three long shared prefixes, each asked four times in turn: every repeat goes where the
  // first went, and finds its prefix there.
  std::vector<std::string> prefixes;
  for (int k = 0; k < 3; ++k) {
    std::string p = "System prompt " + std::to_string(k) + ": ";
    for (int i = 0; i < 8; ++i) p += "rule " + std::to_string(k * 10 + i) + " is to help. ";
    prefixes.push_back(p);
  }
  std::vector<int> home(3, -1);
  for (int user = 0; user < 4; ++user) {
    for (int k = 0; k < 3; ++k) {
      const std::vector<double> was = replica_metric(dp, "tessera:replica_requests_routed", 2);
      Reply r = dp.post("/v1/completions",
                        body(prefixes[k] + "User " + std::to_string(user) + " asks"), "");
      ASSERT_EQ(r.status, 200) << r.body;
      const std::vector<double> now = replica_metric(dp, "tessera:replica_requests_routed", 2);
      const int went = now[0] > was[0] ? 0 : 1;
      if (user == 0) {
        home[k] = went;
      } else {
        EXPECT_EQ(went, home[k]) << "prefix " << k << " user " << user;
        EXPECT_GT(r.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 32);
      }
    }
  }
  const std::vector<double> matched =
      replica_metric(dp, "tessera:replica_prefix_matched_tokens", 2);
  EXPECT_GT(matched[0] + matched[1], 9 * 32);
  EXPECT_EQ(replica_metric(dp, "tessera:replica_healthy", 2), (std::vector<double>{1, 1}));
  // Every routing decision was timed: 2 + 20 + 12 of them.
  EXPECT_EQ(dp.metric("tessera:router_decision_seconds_count"), 34);
}

// Two nodes (two daemons of one cluster on this machine, distinct node identities) and
// `serve -dp 2 --address`: one replica per node; a burst is spread over both; the member's
// daemon SIGKILLed mid-load loses no request: every one is answered, completed or failed naming
// the cause (only those that had streamed may fail), and the service goes on.
TEST_F(ServeTest, ReplicasOnTwoNodesOutliveAMembersDeath) {
  testing::TestCluster cluster;
  const std::string head = cluster.start_head();
  ASSERT_FALSE(head.empty()) << cluster.last().err;
  const std::string member = cluster.start_member("host-b");
  ASSERT_FALSE(member.empty()) << cluster.last().err;
  Server dp(model_, root_,
            {"-dp", "2", "--address", head, "--cluster-token-file",
             cluster.root() + "/cluster_token", "--max-model-len", "512"});
  ASSERT_GT(dp.port(), 0) << dp.process().err();
  const std::string log = dp.process().err();
  const size_t first = log.find("plan: stage 0: "), second = log.find("plan: stage 0: ", first + 1);
  ASSERT_NE(second, std::string::npos) << log;
  EXPECT_NE(log.substr(first, log.find('\n', first) - first).find("host-b") == std::string::npos,
            log.substr(second, log.find('\n', second) - second).find("host-b") == std::string::npos)
      << "one replica per node: " << log;

  auto body = [](int i, int tokens) {
    return json{{"prompt", "Request " + std::to_string(i) + " on two nodes"},
                {"max_tokens", tokens},
                {"temperature", 0},
                {"ignore_eos", true}};
  };
  auto run = [&](int n, int tokens, const std::function<void()>& meanwhile) {
    std::vector<Reply> replies(static_cast<size_t>(n));
    std::vector<std::thread> clients;
    for (int i = 0; i < n; ++i) {
      clients.emplace_back(
          [&, i] { replies[i] = dp.post("/v1/completions", body(i, tokens), ""); });
    }
    meanwhile();
    for (auto& t : clients) t.join();
    return replies;
  };
  for (const Reply& r : run(12, 4, [] {})) EXPECT_EQ(r.status, 200) << r.body;
  const std::vector<double> routed = replica_metric(dp, "tessera:replica_requests_routed", 2);
  EXPECT_LE(std::max(routed[0], routed[1]), 8) << routed[0] << " / " << routed[1];

  const int pid = cluster.daemon_pid(member);
  ASSERT_GT(pid, 0);
  const std::vector<Reply> replies = run(16, 48, [&] {
    std::this_thread::sleep_for(300ms);
    ::kill(pid, SIGKILL);
  });
  int ok = 0, failed = 0;
  for (const Reply& r : replies) {
    if (r.status == 200) {
      ++ok;
      EXPECT_EQ(r.j()["usage"]["completion_tokens"], 48) << r.body;
    } else {
      ++failed;
      EXPECT_GE(r.status, 500) << r.body;  // answered, naming why: its replica's group died
      EXPECT_FALSE(r.j()["error"]["message"].get<std::string>().empty()) << r.body;
    }
  }
  std::printf("[dp] member killed mid-load: %d of 16 completed, %d failed naming the cause\n", ok,
              failed);
  EXPECT_EQ(ok + failed, 16);
  EXPECT_GT(ok, 0);
  // The service goes on: a new request is answered.
  wait_until([&] { return dp.call("GET", "/health").status == 200; }, 30s);
  EXPECT_EQ(dp.post("/v1/completions", body(99, 4), "").status, 200);
}

TEST_F(ServeTest, RoundRobinAlternatesAndBadDataParallelSizesAreRefused) {
  Server rr(model_, root_,
            {"--data-parallel-size", "2", "--router", "round_robin", "--max-model-len", "512"});
  ASSERT_GT(rr.port(), 0) << rr.process().err();
  std::vector<int> went;
  for (int i = 0; i < 4; ++i) {
    const std::vector<double> was = replica_metric(rr, "tessera:replica_requests_routed", 2);
    Reply r = rr.post(
        "/v1/completions",
        json{{"prompt", "Same prompt every time, a long one to share blocks"}, {"max_tokens", 2}},
        "");
    ASSERT_EQ(r.status, 200) << r.body;
    const std::vector<double> now = replica_metric(rr, "tessera:replica_requests_routed", 2);
    went.push_back(now[0] > was[0] ? 0 : 1);
  }
  EXPECT_EQ(went, (std::vector<int>{0, 1, 0, 1}));
  for (std::vector<std::string> bad :
       {std::vector<std::string>{"-dp", "0"}, std::vector<std::string>{"-dp", "two"},
        std::vector<std::string>{"-dp", "2", "--router", "random"}}) {
    std::vector<std::string> argv = {bin("tessera"), "serve", model_, "--device", "cpu"};
    argv.insert(argv.end(), bad.begin(), bad.end());
    CommandResult r = run_command(argv, 30s);
    EXPECT_EQ(r.exit_code, 2) << bad[1];
    EXPECT_NE(r.err.find(bad.size() == 2 ? "data-parallel-size" : "--router"), std::string::npos)
        << r.err;
  }
}

TEST_F(ServeTest, AClientThatGoesAwayIsAbortedAndItsBlocksFreed) {
  const double generated_before = server_->metric("vllm:generation_tokens_total");
  const int fd = connect_local(server_->port());
  ASSERT_GE(fd, 0);
  const std::string body = json{
      {"prompt", "Tell me everything"},
      {"max_tokens", 4000},
      {"ignore_eos", true},
      {"stream", true}}.dump();
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
      "secret\r\nContent-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);  // mid-stream
  EXPECT_TRUE(wait_until(
      [&] {
        return server_->metric("vllm:num_requests_running") == 0 &&
               server_->metric("vllm:kv_cache_usage_perc") == 0;
      },
      10s))
      << "running " << server_->metric("vllm:num_requests_running") << ", KV usage "
      << server_->metric("vllm:kv_cache_usage_perc");
  // Far fewer than the 4000 tokens it asked for were made.
  EXPECT_LT(server_->metric("vllm:generation_tokens_total") - generated_before, 2000);
}

TEST_F(ServeTest, PrefixCacheHitsGiveTheSameAnswer) {
  std::string prompt = "A long shared system prompt that many requests start with: ";
  for (int i = 0; i < 6; ++i) prompt += "rule number " + std::to_string(i) + " is to be kind. ";
  const double hits_before = server_->metric("vllm:prefix_cache_hits_total");
  json body = {
      {"prompt", prompt + "First"}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
  Reply cold = server_->post("/v1/completions", body);
  Reply warm = server_->post("/v1/completions", body);
  ASSERT_EQ(cold.status, 200) << cold.body;
  EXPECT_EQ(warm.j()["choices"][0]["text"], cold.j()["choices"][0]["text"]);
  EXPECT_GT(warm.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 15);
  EXPECT_GT(server_->metric("vllm:prefix_cache_hits_total"), hits_before);
  // Another question after the same prefix shares its blocks too.
  body["prompt"] = prompt + "Second";
  Reply other = server_->post("/v1/completions", body);
  EXPECT_GT(other.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 15);
}

TEST_F(ServeTest, TheOpenAISdkForNodeWorks) {
  const std::string sdk = source("tests/assets/node_modules/openai");
  ASSERT_TRUE(fs::exists(sdk + "/index.mjs")) << "run scripts/fetch-test-assets";
  CommandResult r = run_command(
      {which("node"), source("tests/integration/openai_sdk_check.mjs")}, 120s,
      {"OPENAI_SDK=" + sdk, "BASE_URL=" + server_->url("/v1"), "API_KEY=secret", "MODEL=tiny"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("ALL OK"), std::string::npos) << r.out << r.err;
}

// Every curl command of README.md's shell blocks, run as written against this server (its port
// for localhost:8000, and this suite's API key): each succeeds and answers what its endpoint
// answers. A README example that stops working fails here.
TEST_F(ServeTest, ReadmeCurlExamplesWork) {
  std::ifstream in(source("README.md"));
  ASSERT_TRUE(in) << "no README.md";
  std::vector<std::string> commands;
  bool in_block = false;
  std::string pending;
  for (std::string line; std::getline(in, line);) {
    const size_t start = line.find_first_not_of(' ');
    const std::string text = start == std::string::npos ? "" : line.substr(start);
    if (text.rfind("```", 0) == 0) {
      in_block = !in_block && text.rfind("```sh", 0) == 0;
      continue;
    }
    if (!in_block) continue;
    pending += pending.empty() ? text : " " + text;
    if (!pending.empty() && pending.back() == '\\') {
      pending.pop_back();
      continue;
    }
    if (pending.rfind("curl ", 0) == 0 && pending.find("localhost:8000") != std::string::npos) {
      commands.push_back(pending);
    }
    pending.clear();
  }
  ASSERT_GE(commands.size(), 7u) << "README.md's serving examples are gone";
  for (std::string command : commands) {
    const std::string where = "localhost:8000";
    command.replace(command.find(where), where.size(),
                    "127.0.0.1:" + std::to_string(server_->port()));
    command.replace(0, 5,
                    "curl -sS --fail-with-body --max-time 60 -H 'Authorization: Bearer secret' ");
    CommandResult r = run_command({"/bin/bash", "-c", command}, 90s);
    ASSERT_EQ(r.exit_code, 0) << command << "\n" << r.out << r.err;
    if (command.find("/health") != std::string::npos) continue;  // 200 with no body, as vLLM
    ASSERT_FALSE(r.out.empty()) << command;
    if (command.find("\"stream\": true") != std::string::npos) {
      EXPECT_NE(r.out.find("data: "), std::string::npos) << command << "\n" << r.out;
      EXPECT_NE(r.out.find("data: [DONE]"), std::string::npos) << command << "\n" << r.out;
    } else if (command.find("/metrics") != std::string::npos) {
      EXPECT_NE(r.out.find("vllm:num_requests_running"), std::string::npos) << r.out;
    } else {
      json j = json::parse(r.out, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << command << "\n" << r.out;
      if (command.find("/completions") != std::string::npos) {
        EXPECT_FALSE(j["choices"].empty()) << r.out;
        EXPECT_GT(j["usage"]["completion_tokens"].get<int>(), 0) << r.out;
      }
    }
  }
}

// A model that writes a tool call: a Llama of the tiny shape with Qwen 3's tokenizer and chat
// template, whose weights make it a bigram chain. Each token of the answer has its own
// one-hot embedding, the layers add nothing (o_proj and down_proj zero), and lm_head maps each
// token's direction to the next token, so greedy decoding after the prompt's last token ("\n"
// of "<|im_start|>assistant\n") writes exactly `answer`, then <|im_end|>.
struct ScriptedModel {
  std::string dir;
  std::string answer;  // what it writes
};

ScriptedModel make_tool_call_model(const std::string& root) {
  ScriptedModel m;
  m.dir = root + "/tool-model";
  CommandResult r = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset",
                                 "tiny", "--tokenizer", source("tests/assets/tokenizers/qwen3"),
                                 "--seed", "1", "--dtype", "fp32", "--out", m.dir});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  auto tok = Tokenizer::load(m.dir);
  EXPECT_TRUE(tok) << tok.status().to_string();
  if (!tok) return {};
  const int32_t newline = (*tok)->encode("\n", false).at(0);
  const int32_t im_end = *(*tok)->token_to_id("<|im_end|>");
  // The first call whose tokens are all different (a bigram chain cannot repeat a token).
  std::vector<int32_t> chain;
  for (std::string call : {R"({"name": "get_weather", "arguments": {"city": "Paris"}})",
                           R"({"name":"get_weather","arguments":{"days":3}})",
                           R"({"name":"get_weather","arguments":{}})"}) {
    std::vector<int32_t> ids = (*tok)->encode("<tool_call>" + call + "</tool_call>", false);
    std::vector<int32_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) continue;
    if (std::find(ids.begin(), ids.end(), newline) != ids.end()) continue;
    m.answer = "<tool_call>" + call + "</tool_call>";
    chain = {newline};
    chain.insert(chain.end(), ids.begin(), ids.end());
    break;
  }
  EXPECT_FALSE(chain.empty()) << "no tool call of distinct tokens";
  auto ckpt = Checkpoint::open(m.dir);
  EXPECT_TRUE(ckpt) << ckpt.status().to_string();
  if (!ckpt || chain.empty()) return {};
  std::map<std::string, std::vector<float>> tensors;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const std::string& name : (*ckpt)->names()) {
    auto t = (*ckpt)->tensor(name);
    shapes[name] = t->shape;
    std::vector<float>& v = tensors[name];
    v.assign(static_cast<size_t>(t->numel()), 0.0f);
    if (name.find("norm") != std::string::npos) std::fill(v.begin(), v.end(), 1.0f);
  }
  const int64_t hidden = shapes["model.embed_tokens.weight"][1];
  EXPECT_LT(static_cast<int64_t>(chain.size()), hidden);
  for (size_t i = 0; i < chain.size(); ++i) {
    tensors["model.embed_tokens.weight"][static_cast<size_t>(chain[i] * hidden) + i] = 1.0f;
    const int32_t next = i + 1 < chain.size() ? chain[i + 1] : im_end;
    tensors["lm_head.weight"][static_cast<size_t>(next * hidden) + i] = 4.0f;
  }
  ckpt->reset();  // unmaps the file before it is replaced
  SafetensorsWriter writer;
  for (const auto& [name, v] : tensors) {
    Status st = writer.add(name, DType::kF32, shapes[name],
                           {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)});
    EXPECT_TRUE(st) << st.to_string();
  }
  Status st = writer.write(m.dir + "/model.safetensors");
  EXPECT_TRUE(st) << st.to_string();
  return m;
}

// With tools, the model's <tool_call>{...}</tool_call> comes back as tool_calls (finish_reason
// tool_calls), whole and streamed, through curl and the OpenAI SDK for Node. The server is
// started as the tutorials start vLLM: --model DIR, --trust-remote-code; the tools reach the
// template in the client's key order.
TEST_F(ServeTest, AToolCallTheModelWritesComesBackAsToolCalls) {
  ScriptedModel m = make_tool_call_model(root_);
  ASSERT_FALSE(m.answer.empty());
  Server server("", root_ + "/tool-run",
                {"--model", m.dir, "--trust-remote-code", "--api-key", "secret",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes"});
  ASSERT_GT(server.port(), 0) << server.process().err();
  EXPECT_NE(server.process().err().find("--trust-remote-code: Tessera executes no code"),
            std::string::npos)
      << server.process().err();
  // Qwen 3's template prints each tool with tojson: the prompt holds it as the client wrote it
  // (keys not sorted), as vLLM's does.
  const std::string tool =
      R"({"type": "function", "function": {"name": "get_weather", "description": "Weather", )"
      R"("parameters": {"type": "object", "properties": {"days": {"type": "integer"}, )"
      R"("city": {"type": "string"}}}}})";
  Reply tokenized = server.call(
      "POST", "/tokenize",
      R"({"messages": [{"role": "user", "content": "Paris?"}], "tools": [)" + tool + "]}");
  ASSERT_EQ(tokenized.status, 200) << tokenized.body;
  Reply prompt = server.post("/detokenize", {{"tokens", tokenized.j()["tokens"]}});
  ASSERT_EQ(prompt.status, 200) << prompt.body;
  EXPECT_NE(prompt.j()["prompt"].get<std::string>().find(tool), std::string::npos) << prompt.body;
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "description": "The weather in a city", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])");
  const json messages = {{{"role", "user"}, {"content", "What is the weather in Paris?"}}};
  // The prompt ends with the chain's first token, and without tools the model writes the call
  // as text (no parser runs).
  Reply plain = server.post("/v1/chat/completions",
                            {{"messages", messages}, {"max_tokens", 64}, {"temperature", 0}});
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.j()["choices"][0]["message"]["content"], m.answer) << plain.body;
  EXPECT_EQ(plain.j()["choices"][0]["finish_reason"], "stop");

  const json want_call = json::parse(m.answer.substr(11, m.answer.size() - 11 - 12));
  Reply r = server.post(
      "/v1/chat/completions",
      {{"messages", messages}, {"tools", tools}, {"max_tokens", 64}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json choice = r.j()["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls") << r.body;
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << r.body;
  const json call = choice["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_FALSE(call["id"].get<std::string>().empty());
  EXPECT_EQ(call["function"]["name"], want_call["name"]);
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), want_call["arguments"]);
  EXPECT_TRUE(choice["message"]["content"].is_null() || choice["message"]["content"] == "")
      << r.body;

  // Streamed: the call arrives in tool_calls deltas, never as content.
  Reply s = server.post("/v1/chat/completions", {{"messages", messages},
                                                 {"tools", tools},
                                                 {"max_tokens", 64},
                                                 {"temperature", 0},
                                                 {"stream", true}});
  ASSERT_EQ(s.status, 200) << s.body;
  std::string name, arguments, content, finish;
  std::istringstream lines(s.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    const json chunk = json::parse(line.substr(6));
    for (const json& c : chunk["choices"]) {
      const json& delta = c["delta"];
      if (delta.contains("content") && delta["content"].is_string()) content += delta["content"];
      if (delta.contains("tool_calls")) {
        for (const json& t : delta["tool_calls"]) {
          if (t["function"].contains("name")) name += t["function"]["name"].get<std::string>();
          if (t["function"].contains("arguments")) {
            arguments += t["function"]["arguments"].get<std::string>();
          }
        }
      }
      if (c.contains("finish_reason") && c["finish_reason"].is_string())
        finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(name, want_call["name"]) << s.body;
  EXPECT_EQ(json::parse(arguments), want_call["arguments"]) << s.body;
  EXPECT_EQ(content, "") << s.body;
  EXPECT_EQ(finish, "tool_calls") << s.body;
  EXPECT_NE(s.body.find("data: [DONE]"), std::string::npos);

  // The SDK, whole and streamed.
  const std::string sdk = source("tests/assets/node_modules/openai");
  CommandResult sdk_run =
      run_command({which("node"), source("tests/integration/openai_sdk_tool_call.mjs")}, 120s,
                  {"OPENAI_SDK=" + sdk, "BASE_URL=" + server.url("/v1"), "API_KEY=secret",
                   "MODEL=tiny", "WANT_CALL=" + want_call.dump()});
  EXPECT_EQ(sdk_run.exit_code, 0) << sdk_run.out << sdk_run.err;
  EXPECT_NE(sdk_run.out.find("ALL OK"), std::string::npos) << sdk_run.out << sdk_run.err;
}

// `tessera bench serve` against this server: at a fixed concurrency and at a Poisson rate,
// every request completes with all its tokens, the latency percentiles are ordered, goodput
// counts the requests within the SLOs; a wrong key or no server is a clear failure.
TEST_F(ServeTest, BenchServeMeasuresTheServer) {
  const std::string out = root_ + "/bench-serve.json";
  const std::string base = "http://127.0.0.1:" + std::to_string(server_->port());
  CommandResult r = run_command({bin("tessera"),
                                 "bench",
                                 "serve",
                                 "--base-url",
                                 base,
                                 "--api-key",
                                 "secret",
                                 "--num-prompts",
                                 "24",
                                 "--input-len",
                                 "12",
                                 "--output-len",
                                 "6",
                                 "--max-concurrency",
                                 "6",
                                 "--ignore-eos",
                                 "--goodput",
                                 "ttft:60000",
                                 "tpot:60000",
                                 "--output-json",
                                 out},
                                120s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("24 of 24 requests done"), std::string::npos) << r.err;
  std::ifstream in(out);
  json j = json::parse(in);
  EXPECT_EQ(j["model"], "tiny");  // from /v1/models
  EXPECT_EQ(j["completed"], 24);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_input_tokens"], 24 * 12);
  EXPECT_EQ(j["total_output_tokens"], 24 * 6);
  EXPECT_EQ(j["max_concurrency"], 6);
  EXPECT_NEAR(j["goodput"].get<double>(), j["request_throughput"].get<double>(), 1e-9);
  for (const char* m : {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}) {
    const json& s = j[m];
    EXPECT_GT(s["p50"].get<double>(), 0.0) << m;
    EXPECT_LE(s["p50"].get<double>(), s["p90"].get<double>()) << m;
    EXPECT_LE(s["p90"].get<double>(), s["p99"].get<double>()) << m;
  }
  EXPECT_LT(j["ttft_ms"]["p50"].get<double>(), j["e2el_ms"]["p50"].get<double>());

  // Poisson arrivals, a goodput SLO nobody meets, and the dataset format of bench throughput.
  const std::string data = root_ + "/bench-prompts.jsonl";
  std::ofstream(data) << "{\"prompt\": \"Hello there\", \"output_len\": 3}\n"
                      << "{\"prompt_token_ids\": [100, 200, 300]}\n";
  r = run_command({bin("tessera"), "bench", "serve", "--base-url", base, "--api-key", "secret",
                   "--dataset-path", data, "--output-len", "4", "--ignore-eos", "--request-rate",
                   "20", "--goodput", "e2el:0.001", "--output-json", out, "--json"},
                  120s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // --json: stdout is the result alone (the text went to stderr), the same as the file's.
  const json printed = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(printed.is_discarded()) << r.out;
  EXPECT_NE(r.err.find("ttft_ms"), std::string::npos) << r.err;
  std::ifstream in2(out);
  j = json::parse(in2);
  EXPECT_EQ(printed, j);
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["total_output_tokens"], 3 + 4);
  EXPECT_EQ(j["request_rate"], 20.0);
  EXPECT_EQ(j["goodput"], 0.0);

  r = run_command({bin("tessera"), "bench", "serve", "--base-url", base, "--num-prompts", "2"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("wants an API key"), std::string::npos) << r.err;
  r = run_command({bin("tessera"), "bench", "serve", "--base-url", base, "--model", "tiny",
                   "--api-key", "wrong", "--num-prompts", "2"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("2 failed: HTTP 401"), std::string::npos) << r.out;
  r = run_command({bin("tessera"), "bench", "serve", "--base-url", "http://127.0.0.1:1", "--model",
                   "x", "--num-prompts", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("connecting to http://127.0.0.1:1"), std::string::npos) << r.err;
}

// A raw-socket client: sends a request, reads the response until it ends (or `stop_after`
// bytes, then closes: a client that goes away). What it read.
std::string raw_request(int port, const std::string& method, const std::string& path,
                        const std::string& body, size_t stop_after = 0,
                        const std::string& key = "secret") {
  const int fd = connect_local(port);
  if (fd < 0) return {};
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n";
  if (!key.empty()) req += "Authorization: Bearer " + key + "\r\n";
  req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[4096];
  while (stop_after == 0 || got.size() < stop_after) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return got;
}

// A bounded load with random cancellations: every stream completes or ends cleanly, nothing
// leaks (no running request, the KV cache empty again), and the server still answers.
TEST_F(ServeTest, LoadWithRandomCancellationsEndsCleanly) {
  const int n = 200;  // the issue's bounded load: 200 concurrent streams
  std::vector<std::string> got(n);
  std::vector<bool> cancel(n);
  std::mt19937 rng(5);
  for (int i = 0; i < n; ++i) cancel[i] = rng() % 3 == 0;
  std::vector<std::thread> clients;
  for (int i = 0; i < n; ++i) {
    clients.emplace_back([&, i] {
      const std::string body = json{
          {"prompt", "Client " + std::to_string(i) + " asks"},
          {"max_tokens", 6 + i % 8},
          {"ignore_eos", true},
          {"stream", true}}.dump();
      got[i] = raw_request(server_->port(), "POST", "/v1/completions", body,
                           cancel[i] ? 400 + 37 * (i % 7) : 0);
    });
  }
  for (auto& t : clients) t.join();
  int completed = 0;
  for (int i = 0; i < n; ++i) {
    if (cancel[i]) continue;
    EXPECT_NE(got[i].find("HTTP/1.1 200"), std::string::npos) << i << ": " << got[i];
    EXPECT_NE(got[i].find("data: [DONE]"), std::string::npos) << i << ": " << got[i];
    completed += got[i].find("data: [DONE]") != std::string::npos;
  }
  EXPECT_GT(completed, n / 2);
  EXPECT_TRUE(wait_until(
      [&] {
        return server_->metric("vllm:num_requests_running") == 0 &&
               server_->metric("vllm:num_requests_waiting") == 0 &&
               server_->metric("vllm:kv_cache_usage_perc") == 0;
      },
      15s));
  EXPECT_EQ(
      server_->post("/v1/completions", {{"prompt", "still there?"}, {"max_tokens", 2}}).status,
      200);
}

TEST_F(ServeTest, ABodyOverTheLimitIs413) {
  // The header alone says it: the server answers before reading 64 MiB.
  const int fd = connect_local(server_->port());
  ASSERT_GE(fd, 0);
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\n"
      "Content-Length: 67108864\r\n\r\n{\"prompt\": \"";
  ::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  char buf[512] = {};
  const ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
  ::close(fd);
  ASSERT_GT(n, 0);
  EXPECT_NE(std::string(buf).find(" 413 "), std::string::npos) << buf;
}

// Its own server: the answers without prefix caching are the same, and a killed actor turns
// /health to 503, fails the stream it was serving naming the cause, and is replaced: /health
// returns to 200 and requests are answered as before.
TEST_F(ServeTest, NoPrefixCachingSameAnswersAndADeadActorIsReplaced) {
  Server plain(model_, root_, {"--no-enable-prefix-caching", "--max-model-len", "4096"});
  ASSERT_GT(plain.port(), 0) << plain.process().err();
  json body = {{"prompt", "The capital of France is"},
               {"max_tokens", 8},
               {"temperature", 0},
               {"ignore_eos", true}};
  Reply a = plain.post("/v1/completions", body, "");
  Reply b = server_->post("/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(a.j()["choices"][0]["text"], b.j()["choices"][0]["text"]);
  a = plain.post("/v1/completions", body, "");
  EXPECT_EQ(a.j()["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(plain.call("GET", "/v1/models", "", "").j()["data"][0]["max_model_len"], 4096);

  // Its actor: a child of the embedded node's daemon, a child of the server.
  auto actors_of = [&] {
    std::vector<int> actors;
    for (int daemon : children_of(plain.process().pid())) {
      for (int actor : children_of(daemon)) actors.push_back(actor);
    }
    return actors;
  };
  const std::vector<int> before = actors_of();
  ASSERT_EQ(before.size(), 1u);
  // A long stream is running when the actor dies.
  std::string streamed;
  Clients client(plain);
  client.spawn([&] {
    streamed = raw_request(
        plain.port(), "POST", "/v1/completions",
        json{{"prompt", "Go on"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}}
            .dump(),
        0, "");
  });
  ASSERT_TRUE(wait_until([&] { return plain.metric("vllm:num_requests_running") == 1; }, 20s));
  ASSERT_EQ(::kill(before[0], SIGKILL), 0);
  // Unhealthy from the death notice until the new group serves, or already serving again with
  // the restart counted: a CPU actor's group can restart in 50 ms, inside one poll (a clean-clone
  // CI run saw only 200s then). The bound allows a slow notice under sanitizers on two cores (5 s
  // failed in two of six clean-clone CI runs, the rest of the test passing); the server's log
  // says when each step happened if it fails again.
  const auto killed = std::chrono::steady_clock::now();
  bool saw_503 = false;
  EXPECT_TRUE(wait_until(
      [&] {
        saw_503 = plain.call("GET", "/health").status == 503;
        return saw_503 || plain.metric("tessera:engine_restarts_total") >= 1;
      },
      30s))
      << plain.process().err();
  std::printf("[serve] %s %.2f s after the actor's SIGKILL\n",
              saw_503 ? "/health answered 503" : "the restart was counted (no 503 seen)",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count());
  client.join();
  EXPECT_NE(streamed.find("\"error\""), std::string::npos) << streamed.substr(0, 2000);
  EXPECT_NE(streamed.find("SIGKILL"), std::string::npos) << streamed.substr(0, 2000);
  // Replaced: healthy again, a new actor, the same answers.
  EXPECT_TRUE(wait_until([&] { return plain.call("GET", "/health").status == 200; }, 60s))
      << plain.process().err();
  const std::vector<int> after = actors_of();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_NE(after[0], before[0]);
  Reply again = plain.post("/v1/completions", body, "");
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.j()["choices"][0]["text"], b.j()["choices"][0]["text"]);
  // SIGTERM: a clean exit, nothing left running.
  ASSERT_EQ(::kill(plain.process().pid(), SIGTERM), 0);
  const int status = plain.process().wait(20s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << plain.process().err();
}

// One rank of a TP=2 group (two CPU actors over the TCP collectives) SIGKILLed mid-step: the
// stream it was serving fails naming the dead actor and its signal, the group restarts, and the
// requests queued behind it, which had streamed nothing, are run again and answered as a fresh
// server answers them (issue 31 asks the same of NCCL ranks: named within 2 s; the bound here
// allows sanitizers on two cores, the figure is printed).
TEST_F(ServeTest, ARankOfATensorParallelGroupKilledMidStepRestartsTheGroupAndLosesNoQueuedRequest) {
  Server tp(model_, root_, {"-tp", "2", "--max-num-seqs", "1", "--max-model-len", "4096"});
  ASSERT_GT(tp.port(), 0) << tp.process().err();
  const json body = {{"prompt", "The capital of France is"},
                     {"max_tokens", 8},
                     {"temperature", 0},
                     {"ignore_eos", true}};
  const Reply want = tp.post("/v1/completions", body, "");
  ASSERT_EQ(want.status, 200) << want.body;
  std::vector<int> actors;
  for (int daemon : children_of(tp.process().pid())) {
    for (int actor : children_of(daemon)) actors.push_back(actor);
  }
  ASSERT_EQ(actors.size(), 2u);
  std::string streamed;
  std::chrono::steady_clock::time_point stream_ended;
  Reply queued[2];
  Clients clients(tp);
  clients.spawn([&] {
    streamed = raw_request(
        tp.port(), "POST", "/v1/completions",
        json{{"prompt", "Go on"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}}
            .dump(),
        0, "");
    stream_ended = std::chrono::steady_clock::now();
  });
  ASSERT_TRUE(wait_until([&] { return tp.metric("vllm:num_requests_running") == 1; }, 20s));
  for (Reply& r : queued) {
    Reply* out = &r;
    clients.spawn([&tp, &body, out] { *out = tp.post("/v1/completions", body, ""); });
  }
  ASSERT_TRUE(wait_until([&] { return tp.metric("vllm:num_requests_waiting") == 2; }, 20s));
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(actors[1], SIGKILL), 0);
  clients.join();
  const double named_s = std::chrono::duration<double>(stream_ended - killed).count();
  std::printf("[serve] TP=2 rank killed: its stream failed %.2f s later\n", named_s);
  EXPECT_LT(named_s, 15.0);
  EXPECT_NE(streamed.find("\"error\""), std::string::npos) << streamed.substr(0, 2000);
  EXPECT_NE(streamed.find("SIGKILL"), std::string::npos) << streamed.substr(0, 2000);
  EXPECT_NE(streamed.find("actor a-"), std::string::npos) << streamed.substr(0, 2000);
  for (const Reply& r : queued) {
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.j()["choices"][0]["text"], want.j()["choices"][0]["text"]);
  }
  EXPECT_GE(tp.metric("tessera:engine_restarts_total"), 1);
  EXPECT_TRUE(wait_until([&] { return tp.call("GET", "/health", "", "").status == 200; }, 60s));
  const Reply again = tp.post("/v1/completions", body, "");
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.j()["choices"][0]["text"], want.j()["choices"][0]["text"]);
}

// SIGTERM while clients stream: the streams end, the server exits 0 and stops its actors.
TEST_F(ServeTest, SigtermWhileStreamingExitsCleanly) {
  Server s(model_, root_);
  ASSERT_GT(s.port(), 0) << s.process().err();
  std::atomic<int> ended{0};
  Clients clients(s);
  for (int i = 0; i < 3; ++i) {
    clients.spawn([&] {
      s.post("/v1/completions",
             {{"prompt", "Go on"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}},
             "");
      ended++;
    });
  }
  ASSERT_TRUE(wait_until([&] { return s.metric("vllm:num_requests_running") == 3; }, 20s));
  std::vector<int> actors;
  for (int daemon : children_of(s.process().pid())) {
    for (int actor : children_of(daemon)) actors.push_back(actor);
  }
  ASSERT_FALSE(actors.empty());
  ASSERT_EQ(::kill(s.process().pid(), SIGTERM), 0);
  const int status = s.process().wait(20s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << s.process().err();
  clients.join();
  EXPECT_EQ(ended.load(), 3);
  EXPECT_TRUE(wait_until([&] { return !testing::process_alive(actors[0]); }, 10s));
}

// ---- hostile clients: memory before authentication, connection limits, the I/O thread ----

// A field of /proc/PID/status in kB (VmRSS, VmHWM), or -1.
long status_kb(int pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return -1;
}

void set_timeouts(int fd, std::chrono::milliseconds t) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Everything the peer sends until it closes, fails, or the receive timeout passes.
std::string read_all(int fd) {
  std::string got;
  char buf[4096];
  while (true) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

// Seconds until the server closes `fd` (recv gives 0 or an error), or -1 after `limit`.
// `tick` runs every 100 ms meanwhile (a slow client's next bytes).
double seconds_until_closed(int fd, std::chrono::milliseconds limit,
                            const std::function<void()>& tick = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < limit) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      char buf[4096];
      const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      continue;  // an answer: read on
    }
    if (tick) tick();
  }
  return -1;
}

// 20 clients without the key announce 30 MiB bodies and stream 6 MiB each: each gets its 401
// from the header, and the server keeps none of it (it used to read the whole body before the
// key: 20 such clients took it from 71 MB to 706 MB).
TEST_F(ServeTest, WithoutTheKeyNoBodyIsRead) {
  const int pid = server_->process().pid();
  const long before = status_kb(pid, "VmRSS");
  ASSERT_GT(before, 0);
  const int kClients = 20;
  const size_t kStream = 6 << 20;
  std::vector<int> fds;
  for (int i = 0; i < kClients; ++i) {
    fds.push_back(connect_local(server_->port()));
    ASSERT_GE(fds.back(), 0);
    set_timeouts(fds.back(), 3s);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> senders;
  for (int i = 0; i < kClients; ++i) {
    senders.emplace_back([&, fd = fds[i]] {
      const std::string head =
          "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          "Content-Length: " +
          std::to_string(30 << 20) + "\r\n\r\n";
      if (::send(fd, head.data(), head.size(), MSG_NOSIGNAL) <= 0) return;
      const std::string chunk(64 << 10, 'a');
      for (size_t sent = 0; sent < kStream;) {
        const ssize_t n = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
        if (n <= 0) break;  // the server closed: it does not read bodies without the key
        sent += static_cast<size_t>(n);
      }
    });
  }
  for (auto& t : senders) t.join();
  // Every client has sent what it could; the connections are still open on this side.
  const long during = status_kb(pid, "VmRSS");
  for (int i = 0; i < kClients; ++i) {
    const std::string got = read_all(fds[i]);
    ::close(fds[i]);
    EXPECT_NE(got.find("HTTP/1.1 401 "), std::string::npos) << i << ": " << got;
    EXPECT_NE(got.find("AuthenticationError"), std::string::npos) << i << ": " << got;
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 10.0);
  EXPECT_LT(during - before, 16 << 10) << "RSS " << before << " kB -> " << during << " kB";
  // The server goes on.
  EXPECT_EQ(server_->call("GET", "/health", "", "").status, 200);
  EXPECT_EQ(server_->post("/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}}).status, 200);
  // A 401 from the header alone also for a small body, and for other routes.
  EXPECT_NE(raw_request(server_->port(), "POST", "/tokenize", R"({"prompt": "x"})", 0, "wrong")
                .find("HTTP/1.1 401 "),
            std::string::npos);
}

// /health answers at once while a prompt of megabytes is parsed and tokenized (on a worker: it
// used to run on the one I/O thread, and a 30 MB prompt stalled /health for 3 s).
TEST_F(ServeTest, HealthAnswersWhileALargePromptIsTokenized) {
  std::mt19937 rng(7);
  std::string prompt;
  const size_t kSize = 8 << 20;
  prompt.reserve(kSize + 16);
  while (prompt.size() < kSize) {
    const int len = 1 + static_cast<int>(rng() % 9);
    for (int k = 0; k < len; ++k) prompt.push_back(static_cast<char>('a' + rng() % 26));
    prompt += rng() % 13 == 0 ? ".\n" : " ";
  }
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 1}}.dump();
  std::atomic<bool> done{false};
  std::string answer;
  double big_seconds = 0;
  std::thread client([&] {
    const auto t0 = std::chrono::steady_clock::now();
    answer = raw_request(server_->port(), "POST", "/v1/completions", body);
    big_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    done = true;
  });
  std::vector<double> latencies;  // of the polls that started while it ran
  while (!done) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string health = raw_request(server_->port(), "GET", "/health", "", 0, "");
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(health.find("HTTP/1.1 200 "), std::string::npos) << health;
    latencies.push_back(ms);
    std::this_thread::sleep_for(20ms);
  }
  client.join();
  // Tokenized whole, then refused as too long for the context.
  EXPECT_NE(answer.find("HTTP/1.1 400 "), std::string::npos) << answer.substr(0, 500);
  EXPECT_NE(answer.find("maximum context length"), std::string::npos) << answer.substr(0, 500);
  ASSERT_GE(latencies.size(), 5u) << "the large prompt took only " << big_seconds << " s";
  const double worst = *std::max_element(latencies.begin(), latencies.end());
  EXPECT_LT(worst, 250.0) << "ms for /health; " << latencies.size() << " polls during "
                          << big_seconds << " s";
}

// The TCP socket that listens on `port` (state 0A in /proc/net/tcp): its inode, or "".
std::string listening_inode(int port) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
          inode;
      const size_t colon = local.rfind(':');
      if (colon == std::string::npos || state != "0A") continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) return inode;
    }
  }
  return {};
}

// The established connection from local port `from` to `to`, seen from `to`'s side: its inode.
std::string connection_inode(int to, int from) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    f >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >>
        inode;
    if (state != "01") continue;
    const int lp = std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16);
    const int rp = std::stoi(remote.substr(remote.rfind(':') + 1), nullptr, 16);
    if (lp == to && rp == from) return inode;
  }
  return {};
}

// Process `pid`'s descriptor that is socket `inode`, or -1.
int fd_of_socket(int pid, const std::string& inode) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    if (fs::read_symlink(e.path(), ec).string() == "socket:[" + inode + "]") {
      return std::atoi(e.path().filename().c_str());
    }
  }
  return -1;
}

// Whether descriptor `fd` of `pid` is close-on-exec (O_CLOEXEC in its fdinfo flags, octal).
bool is_cloexec(int pid, int fd) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/fdinfo/" + std::to_string(fd));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("flags:", 0) == 0) return (std::stoul(line.substr(6), nullptr, 8) & 02000000);
  }
  return false;
}

std::vector<int> descendants_of(int pid) {
  std::vector<int> out;
  for (int child : children_of(pid)) {
    out.push_back(child);
    for (int d : descendants_of(child)) out.push_back(d);
  }
  return out;
}

// The listening socket and accepted connections are close-on-exec: the local node's daemon and
// its actors (forked after the server bound its port) hold neither.
TEST_F(ServeTest, NoChildHoldsTheServersSockets) {
  const int pid = server_->process().pid();
  const std::string listening = listening_inode(server_->port());
  ASSERT_FALSE(listening.empty());
  const int listen_fd = fd_of_socket(pid, listening);
  ASSERT_GE(listen_fd, 0);
  EXPECT_TRUE(is_cloexec(pid, listen_fd));
  const std::vector<int> children = descendants_of(pid);
  ASSERT_GE(children.size(), 2u);  // the daemon and its actor
  for (int child : children) {
    EXPECT_EQ(fd_of_socket(child, listening), -1)
        << "pid " << child << " (" << testing::cmdline_of(child) << ") holds the HTTP port";
  }
  // An accepted connection.
  const int fd = connect_local(server_->port());
  ASSERT_GE(fd, 0);
  sockaddr_in me{};
  socklen_t len = sizeof(me);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len), 0);
  std::string accepted;
  int accepted_fd = -1;
  EXPECT_TRUE(wait_until(
      [&] {
        accepted = connection_inode(server_->port(), ntohs(me.sin_port));
        accepted_fd = accepted.empty() ? -1 : fd_of_socket(pid, accepted);
        return accepted_fd >= 0;
      },
      3s));
  EXPECT_TRUE(accepted_fd >= 0 && is_cloexec(pid, accepted_fd));
  ::close(fd);
}

// Its own server with small limits: a connection over --max-connections is answered 503; idle
// connections, keep-alive ones after a request and slow headers are closed after
// --timeout-keep-alive; accept failing for lack of descriptors is logged once per 5 s, not every
// 50 ms, and the server recovers.
TEST_F(ServeTest, ConnectionLimitsAndAcceptFailures) {
  // Bad values fail before anything starts.
  CommandResult bad =
      run_command({bin("tessera"), "serve", model_, "--device", "cpu", "--max-connections", "0"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--max-connections must be at least 1"), std::string::npos) << bad.err;
  bad = run_command(
      {bin("tessera"), "serve", model_, "--device", "cpu", "--timeout-keep-alive", "0"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--timeout-keep-alive must be"), std::string::npos) << bad.err;

  Server s(model_, root_, {"--max-connections", "4", "--timeout-keep-alive", "2"});
  ASSERT_GT(s.port(), 0) << s.process().err();

  // An idle connection.
  int fd = connect_local(s.port());
  ASSERT_GE(fd, 0);
  double closed = seconds_until_closed(fd, 8s);
  EXPECT_GT(closed, 1.5);
  EXPECT_LT(closed, 5.0);
  ::close(fd);
  // A keep-alive connection after its request.
  fd = connect_local(s.port());
  const std::string get = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  closed = seconds_until_closed(fd, 8s);
  EXPECT_GT(closed, 1.5);
  EXPECT_LT(closed, 5.0);
  ::close(fd);
  // A header sent a line every 100 ms, never finished.
  fd = connect_local(s.port());
  const std::string start = "GET /health HTTP/1.1\r\n";
  ::send(fd, start.data(), start.size(), MSG_NOSIGNAL);
  closed = seconds_until_closed(fd, 8s, [&] { ::send(fd, "X-Slow: 1\r\n", 11, MSG_NOSIGNAL); });
  EXPECT_GT(closed, 1.5);
  EXPECT_LT(closed, 5.0);
  ::close(fd);

  // Four connections open: the fifth is answered 503, and served once they close.
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(connect_local(s.port()));
    ASSERT_GE(held.back(), 0);
  }
  std::this_thread::sleep_for(200ms);  // accepted (well within the 2 s idle timeout)
  const std::string refused = raw_request(s.port(), "GET", "/health", "", 0, "");
  EXPECT_NE(refused.find("HTTP/1.1 503 "), std::string::npos) << refused;
  EXPECT_NE(refused.find("--max-connections"), std::string::npos) << refused;
  for (int h : held) ::close(h);
  EXPECT_TRUE(wait_until(
      [&] {
        return raw_request(s.port(), "GET", "/health", "", 0, "").find("HTTP/1.1 200 ") !=
               std::string::npos;
      },
      3s));

  // No descriptor left: the soft limit at the lowest free descriptor number.
  const int pid = s.process().pid();
  int lowest_free = 0;
  while (fs::exists("/proc/" + std::to_string(pid) + "/fd/" + std::to_string(lowest_free))) {
    ++lowest_free;
  }
  rlimit old{};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, nullptr, &old), 0);
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &tight, nullptr), 0);
  const size_t log_before = s.process().err().size();
  std::vector<int> waiting;
  for (int i = 0; i < 3; ++i) {  // in the backlog, their requests sent
    waiting.push_back(connect_local(s.port()));
    ASSERT_GE(waiting.back(), 0);
    ASSERT_EQ(::send(waiting.back(), get.data(), get.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(get.size()));
  }
  std::this_thread::sleep_for(4s);
  const std::string log = s.process().err().substr(log_before);
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &old, nullptr), 0);
  size_t lines = 0;
  for (size_t at = log.find("accept failed"); at != std::string::npos;
       at = log.find("accept failed", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1u) << log;
  EXPECT_LE(lines, 2u) << log;
  EXPECT_NE(log.find("ulimit -n"), std::string::npos) << log;
  // Recovered: the waiting clients are served.
  for (int w : waiting) {
    set_timeouts(w, 5s);
    char buf[256] = {};
    EXPECT_GT(::recv(w, buf, sizeof(buf) - 1, 0), 0);
    EXPECT_NE(std::string(buf).find("HTTP/1.1 200 "), std::string::npos) << buf;
    ::close(w);
  }
  EXPECT_TRUE(wait_until(
      [&] { return s.process().err().find("accept works again") != std::string::npos; }, 3s));
}

// The replica_info series of /metrics (-dp): each replica's state ("serving", "draining",
// "removed"), by replica index.
std::map<size_t, std::string> replica_states(const Server& server) {
  std::map<size_t, std::string> out;
  std::istringstream lines(server.call("GET", "/metrics").body);
  static const std::regex info(
      "tessera:replica_info\\{model_name=\"[^\"]*\",replica=\"([0-9]+)\",state=\"([a-z]+)\","
      "nodes=\"[^\"]*\"\\} 1");
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, info)) out[std::stoul(m[1])] = m[2];
  }
  return out;
}

// Scale out over three hosts (network namespaces on a bridge; loopback daemons where they
// cannot be made): `serve -dp auto` on a head and one member runs a replica on each; an idle
// burst is spread (neither over 60%), the repeats of a prefix go where it is cached; a third
// host that joins while requests keep coming gets a replica that then takes traffic;
// `tessera drain` of it stops routing there, lets its requests finish and removes it; the
// member's daemon SIGKILLed mid-load fails only streams that had started. Every request of
// every phase is counted.
TEST_F(ServeTest, ScaleOutOverHostsThatJoinDrainAndDie) {
  testing::NetnsHosts net(3);
  if (!net.ok()) {
    std::fprintf(stderr,
                 "\n*** [scale-out] NETWORK NAMESPACES ARE NOT AVAILABLE HERE (ip netns needs "
                 "root): the three hosts are daemons on loopback ***\n\n");
  } else {
    std::printf("[scale-out] hosts: %s (head, server), %s, %s on a bridge\n", net.addr(0).c_str(),
                net.addr(1).c_str(), net.addr(2).c_str());
  }
  auto node_ip = [&](size_t host) {
    return net.ok() ? std::vector<std::string>{"--node-ip", net.addr(host)}
                    : std::vector<std::string>{};
  };
  net.enter(0);
  testing::TestCluster cluster;
  const std::string head = cluster.start_head(node_ip(0));
  ASSERT_FALSE(head.empty()) << cluster.last().err;
  const std::string token_file = cluster.root() + "/cluster_token";
  auto join = [&](size_t host, const std::string& name) {
    net.enter(host);
    std::vector<std::string> extra = node_ip(host);
    extra.insert(extra.end(), {"--cluster-token-file", token_file});
    const std::string id = cluster.start_member(name, extra);
    net.enter(0);
    return id;
  };
  const std::string member = join(1, "host-b");
  ASSERT_FALSE(member.empty()) << cluster.last().err;
  Server dp(model_, root_,
            {"-dp", "auto", "--address", head, "--cluster-token-file", token_file,
             "--max-model-len", "512"});
  ASSERT_GT(dp.port(), 0) << dp.process().err();
  EXPECT_NE(dp.process().err().find("-dp auto: 2 replica(s) fit now"), std::string::npos)
      << dp.process().err();
  ASSERT_EQ(replica_states(dp), (std::map<size_t, std::string>{{0, "serving"}, {1, "serving"}}));

  auto body = [](const std::string& prompt, int tokens) {
    return json{
        {"prompt", prompt}, {"max_tokens", tokens}, {"temperature", 0}, {"ignore_eos", true}};
  };
  // An idle-start burst of 20 distinct prompts.
  {
    std::vector<std::thread> burst;
    std::vector<int> status(20, 0);
    for (int i = 0; i < 20; ++i) {
      burst.emplace_back([&, i] {
        status[i] =
            dp.post("/v1/completions",
                    body("Burst " + std::to_string(i) + " asks about " + std::to_string(i * 13), 4),
                    "")
                .status;
      });
    }
    for (auto& t : burst) t.join();
    EXPECT_EQ(std::count(status.begin(), status.end(), 200), 20);
    const std::vector<double> routed = replica_metric(dp, "tessera:replica_requests_routed", 2);
    EXPECT_EQ(routed[0] + routed[1], 20);
    EXPECT_LE(std::max(routed[0], routed[1]), 12) << routed[0] << " / " << routed[1];
  }
  // Shared prefixes: every repeat goes to the replica its first request went to.
  for (int k = 0; k < 3; ++k) {
    std::string prefix = "Host system prompt " + std::to_string(k) + ": ";
    for (int i = 0; i < 8; ++i) prefix += "clause " + std::to_string(k * 10 + i) + " applies. ";
    int home = -1;
    for (int user = 0; user < 3; ++user) {
      const std::vector<double> was = replica_metric(dp, "tessera:replica_requests_routed", 2);
      Reply r = dp.post("/v1/completions", body(prefix + "User " + std::to_string(user), 2), "");
      ASSERT_EQ(r.status, 200) << r.body;
      const std::vector<double> now = replica_metric(dp, "tessera:replica_requests_routed", 2);
      const int went = now[0] > was[0] ? 0 : 1;
      if (home < 0) home = went;
      EXPECT_EQ(went, home) << "prefix " << k << " user " << user;
    }
  }

  // Steady load from four clients while the cluster changes; every answer counted.
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<int, int> statuses;
  auto load = [&] {
    std::vector<std::thread> clients;
    for (int c = 0; c < 4; ++c) {
      clients.emplace_back([&, c] {
        for (int i = 0; !stop; ++i) {
          Reply r =
              dp.post("/v1/completions",
                      body("Client " + std::to_string(c) + " request " + std::to_string(i), 6), "");
          std::lock_guard lock(mu);
          ++statuses[r.status];
          if (r.status != 200) std::printf("[scale-out] %d: %s\n", r.status, r.body.c_str());
        }
      });
    }
    return clients;
  };
  auto settle = [&](std::vector<std::thread>& clients) {
    stop = true;
    for (auto& t : clients) t.join();
    stop = false;
    std::lock_guard lock(mu);
    const int total = statuses[200];
    EXPECT_EQ(statuses.size(), 1u) << "every request answered 200";
    statuses.clear();
    return total;
  };

  // A third host joins mid-load: -dp auto gives it a replica, which then takes requests.
  std::vector<std::thread> clients = load();
  const std::string third = join(2, "host-c");
  EXPECT_FALSE(third.empty()) << cluster.last().err;
  if (third.empty()) {
    settle(clients);
    return;
  }
  EXPECT_TRUE(wait_until([&] { return replica_states(dp)[2] == "serving"; }, 60s))
      << dp.process().err();
  EXPECT_TRUE(wait_until(
      [&] { return replica_metric(dp, "tessera:replica_requests_routed", 3)[2] > 0; }, 30s));
  const double routed_before_drain = replica_metric(dp, "tessera:replica_requests_routed", 3)[2];
  std::printf("[scale-out] host-c joined: replica 2 serving; %d requests answered meanwhile\n",
              settle(clients));

  // `tessera drain host-c` mid-load: no new requests go there, and once its requests finish
  // it is removed (its actors stop); nothing fails.
  clients = load();
  CommandResult drained = cluster.tessera(
      {"drain", "host-c", "--address", head, "--cluster-token-file", token_file, "--wait", "60"});
  EXPECT_EQ(drained.exit_code, 0) << drained.out << drained.err;
  EXPECT_TRUE(wait_until([&] { return replica_states(dp)[2] == "removed"; }, 30s))
      << dp.process().err();
  const double routed_after_drain = replica_metric(dp, "tessera:replica_requests_routed", 3)[2];
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(replica_metric(dp, "tessera:replica_requests_routed", 3)[2], routed_after_drain);
  EXPECT_GE(routed_after_drain, routed_before_drain);
  std::printf(
      "[scale-out] host-c drained and its replica removed; %d requests answered "
      "meanwhile\n",
      settle(clients));
  CommandResult bad =
      cluster.tessera({"drain", "host-z", "--address", head, "--cluster-token-file", token_file});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("host-z"), std::string::npos) << bad.err;

  // host-b's daemon SIGKILLed mid-load, streams in flight: a stream fails only if it had
  // streamed tokens (its KV cache is gone); the others finish, moved or not.
  const int pid = cluster.daemon_pid(member);
  ASSERT_GT(pid, 0);
  constexpr int kStreams = 16;
  std::vector<Reply> streams(kStreams);
  std::vector<std::thread> streaming;
  for (int i = 0; i < kStreams; ++i) {
    streaming.emplace_back([&, i] {
      json b = body("Stream " + std::to_string(i) + " over the hosts", 48);
      b["stream"] = true;
      streams[i] = dp.post("/v1/completions", b, "");
    });
  }
  std::this_thread::sleep_for(300ms);
  ::kill(pid, SIGKILL);
  for (auto& t : streaming) t.join();
  int completed = 0, failed_after_start = 0;
  for (int i = 0; i < kStreams; ++i) {
    const std::string& sse = streams[i].body;
    const bool started = sse.find("\"text\"") != std::string::npos;
    const bool failed = sse.find("\"error\"") != std::string::npos || streams[i].status != 200;
    if (failed) {
      ++failed_after_start;
      EXPECT_TRUE(started) << "stream " << i << " failed before it streamed anything: " << sse;
    } else {
      ++completed;
      EXPECT_NE(sse.find("data: [DONE]"), std::string::npos) << sse;
    }
  }
  std::printf(
      "[scale-out] host-b killed mid-load: %d of %d streams completed, %d failed after "
      "streaming (naming the cause)\n",
      completed, kStreams, failed_after_start);
  EXPECT_EQ(completed + failed_after_start, kStreams);
  EXPECT_GT(completed, 0);
  wait_until([&] { return dp.call("GET", "/health").status == 200; }, 30s);
  EXPECT_EQ(dp.post("/v1/completions", body("After the storm", 4), "").status, 200);
}

}  // namespace
}  // namespace tessera
