// tessera._tessera: the C++ driver library as Python sees it. Every call goes through the same
// LLM (driver/llm.h), ModelSession, planner and worker group as the CLI; the engine's keywords
// are the CLI's flags, parsed by the CLI's own parser (add_engine_options), so there is one list
// of engine options and one validator. tessera/__init__.py builds vLLM's API over this module.
//
// Threads: the GIL is released while the engine works (loading, stepping, stopping actors); it
// is taken back only to ask the interpreter whether a signal came (Ctrl-C aborts the call's
// requests and raises KeyboardInterrupt) and to report a finished request to Python.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/session.h"
#include "driver/chat_setup.h"
#include "driver/llm.h"
#include "driver/local_node.h"
#include "driver/status.h"
#include "protocol/auth.h"

namespace py = pybind11;

namespace tessera::python {
namespace {

// ---- errors: INVALID_ARGUMENT is ValueError, anything else RuntimeError, with the C++ message

[[noreturn]] void raise(const Status& status) {
  // A signal handler (KeyboardInterrupt) or a callback raised while the engine ran: that
  // exception, not the status it turned into.
  if (PyErr_Occurred() != nullptr) throw py::error_already_set();
  if (status.code() == Code::kInvalidArgument) throw py::value_error(status.message());
  throw std::runtime_error(status.message());
}

template <typename T>
T unwrap(Expected<T> value) {
  if (!value) raise(value.status());
  return std::move(*value);
}

// ---- engine keywords: the CLI's engine flags, as vLLM's keyword arguments

// Flags a Python caller does not pass as LLM keywords: the model is LLM's first argument, and
// the cluster comes from tessera.init().
bool python_sets(const std::string& name) {
  return name == "model" || name == "address" || name == "cluster-token-file" || name == "help";
}

std::string keyword_of(std::string flag) {
  for (char& c : flag) c = c == '-' ? '_' : c;
  return flag;
}

struct EngineKeyword {
  std::string keyword, flag, help;
  bool is_flag = false;  // a switch: True / False
};

std::vector<EngineKeyword> engine_keywords() {
  CLI::App app;
  EngineArgs args;
  add_engine_options(&app, args);
  std::vector<EngineKeyword> out;
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_lnames().empty() || python_sets(o->get_lnames().front())) continue;
    const std::string& name = o->get_lnames().front();
    out.push_back(
        {keyword_of(name), "--" + name, o->get_description(), o->get_expected_min() == 0});
  }
  return out;
}

// "true"/"false", a number, a string, or a list joined by commas (pipeline_layer_partition).
std::string flag_text(const std::string& keyword, const py::handle& value) {
  if (py::isinstance<py::bool_>(value)) return value.cast<bool>() ? "true" : "false";
  if (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value) ||
      py::isinstance<py::str>(value)) {
    return py::str(value).cast<std::string>();
  }
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    std::string text;
    for (const py::handle item : value) {
      text += (text.empty() ? "" : ",") + flag_text(keyword, item);
    }
    return text;
  }
  throw py::type_error(keyword + ": expected a bool, number, string or list, got " +
                       py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>());
}

// EngineArgs from LLM's keywords, each parsed by the CLI's parser (one at a time, so that an
// error names its keyword). None keeps the default.
EngineArgs engine_args(const std::string& model, const py::dict& options) {
  EngineArgs args;
  CLI::App app;
  add_engine_options(&app, args);
  std::vector<std::string> known;
  for (const EngineKeyword& k : engine_keywords()) known.push_back(k.keyword);
  for (const auto& [key, value] : options) {
    const std::string keyword = py::str(key).cast<std::string>();
    if (std::find(known.begin(), known.end(), keyword) == known.end()) {
      throw py::type_error("LLM() got an unexpected keyword argument '" + keyword +
                           "' (help(tessera.LLM) lists the engine's keywords)");
    }
    if (value.is_none()) continue;
    std::string flag = "--" + keyword;
    for (char& c : flag) c = c == '_' ? '-' : c;
    // CLI11 takes its arguments in reverse order.
    std::vector<std::string> argv = {flag + "=" + flag_text(keyword, value), model, "--model"};
    try {
      app.parse(argv);
    } catch (const CLI::ParseError& e) {
      throw py::value_error(keyword + "=" + py::repr(value).cast<std::string>() + ": " + e.what());
    }
  }
  args.model = model;
  return args;
}

// The spec the keywords give, as a dict (what tests check each keyword against).
py::dict spec_dict(const EngineSpec& e) {
  py::dict d;
  d["model"] = e.model;
  d["dtype"] = e.dtype;
  d["device"] = device_name(e.device);
  d["quantization"] = quant_method_name(e.quantization);
  d["tensor_parallel_size"] = e.tensor_parallel_size.to_string();
  d["pipeline_parallel_size"] =
      e.pipeline_parallel_size ? py::cast(e.pipeline_parallel_size->to_string()) : py::none();
  d["pipeline_layer_partition"] = e.pipeline_layer_partition;
  d["enable_expert_parallel"] = e.enable_expert_parallel;
  d["load_format"] = load_format_name(e.load_format);
  d["max_model_len"] = e.max_model_len;
  d["gpu_memory_utilization"] = e.gpu_memory_utilization;
  d["max_num_seqs"] = e.max_num_seqs;
  d["max_num_batched_tokens"] = e.max_num_batched_tokens;
  d["block_size"] = e.block_size;
  d["num_gpu_blocks_override"] = e.num_gpu_blocks_override;
  d["kv_cache_dtype"] = kv_cache_dtype_name(e.kv_cache_dtype);
  d["enforce_eager"] = e.enforce_eager;
  d["enable_prefix_caching"] = e.enable_prefix_caching;
  d["async_scheduling"] = e.async_scheduling;
  d["collectives"] = collectives_name(e.collectives);
  d["disable_custom_all_reduce"] = e.disable_custom_all_reduce;
  d["nccl_init_timeout"] = e.nccl_init_timeout_s;
  return d;
}

// engine_args, validated as LLM() validates them before it starts anything.
py::dict engine_args_dict(const std::string& model, const py::dict& options) {
  EngineArgs args = engine_args(model, options);
  if (Status st = validate(args); !st) raise(st);
  return spec_dict(args);
}

// ---- results

double epoch_seconds(std::chrono::steady_clock::time_point t) {
  const auto offset = std::chrono::system_clock::now().time_since_epoch() -
                      std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::duration<double>(t.time_since_epoch() + offset).count();
}

py::list logprobs_list(const std::vector<TokenLogprobs>& logprobs) {
  py::list out;
  for (const TokenLogprobs& l : logprobs) {
    out.append(py::make_tuple(l.token, l.logprob, l.top));
  }
  return out;
}

// One request's result as a dict; tessera/__init__.py shapes it into vLLM's RequestOutput.
py::dict result_dict(const GenerationResult& r) {
  py::dict d;
  d["prompt_token_ids"] = r.prompt_token_ids;
  d["text"] = r.text;
  d["token_ids"] = r.token_ids;
  d["logprobs"] = logprobs_list(r.logprobs);
  d["finish_reason"] = std::string(finish_reason_name(r.finish_reason));
  d["stop_reason"] = r.stop_reason;
  d["num_cached_tokens"] = r.cached_tokens;
  d["arrival_time"] = epoch_seconds(r.arrival);
  d["first_token_time"] =
      r.first_token ? py::cast(epoch_seconds(*r.first_token)) : py::object(py::none());
  d["finished_time"] = epoch_seconds(r.finished);
  return d;
}

py::dict output_dict(const RequestOutput& o) {
  py::dict d;
  d["delta"] = o.delta;
  d["new_token_ids"] = o.new_tokens;
  d["new_logprobs"] = logprobs_list(o.new_logprobs);
  d["finished"] = o.finished;
  d["finish_reason"] = std::string(finish_reason_name(o.finish_reason));
  d["stop_reason"] = o.stop_reason;
  d["prompt_tokens"] = o.prompt_tokens;
  d["num_cached_tokens"] = o.cached_tokens;
  return d;
}

// ---- sampling parameters: the C++ SamplingParams and n (the copies of each prompt)

struct PySamplingParams : SamplingParams {
  int n = 1;  // as the server's `n`: 1..kMaxN, seeds stepped per copy
  static constexpr int kMaxN = 128;

  void check() const {
    if (n < 1 || n > kMaxN) {
      throw py::value_error("n must be between 1 and " + std::to_string(kMaxN) + ", got " +
                            std::to_string(n));
    }
    if (Status st = validate(); !st) throw py::value_error(st.message());
  }
};

// stop: a string or a list of strings, as vLLM takes it.
std::vector<std::string> stop_list(const py::object& stop) {
  if (stop.is_none()) return {};
  if (py::isinstance<py::str>(stop)) return {stop.cast<std::string>()};
  try {
    return stop.cast<std::vector<std::string>>();
  } catch (const py::cast_error&) {
    throw py::type_error("stop: expected a string or a list of strings");
  }
}

// ---- the engine

// The thread an LLM's engine lives on. kj's event loop is one per thread, and every
// ModelSession (and a status query) has its own: so each LLM gets a thread of its own, and
// several LLMs (or tessera.nodes() beside an LLM) can live in one interpreter. The calling
// thread waits with the GIL released, waking every kPoll to ask the interpreter whether a
// signal came (only the main thread can); Ctrl-C sets `interrupted`, which the engine sees
// between steps (LLM::set_interrupt) and which aborts the call's requests.
class EngineThread {
 public:
  static constexpr std::chrono::milliseconds kPoll{50};

  EngineThread() : thread_([this] { loop(); }) {}
  ~EngineThread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  EngineThread(const EngineThread&) = delete;
  EngineThread& operator=(const EngineThread&) = delete;

  // Runs `work` on the engine thread and returns its result; the caller holds the GIL and has
  // it again on return (with KeyboardInterrupt set when Ctrl-C came meanwhile).
  template <typename F>
  auto call(F&& work) -> decltype(work()) {
    using R = decltype(work());
    interrupted.store(false);
    std::packaged_task<R()> task(std::forward<F>(work));
    std::future<R> done = task.get_future();
    {
      std::lock_guard lock(mu_);
      tasks_.emplace_back([&task] { task(); });
    }
    cv_.notify_one();
    bool signalled = false;
    {
      py::gil_scoped_release release;
      while (done.wait_for(kPoll) != std::future_status::ready) {
        if (signalled) continue;
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) {
          signalled = true;
          interrupted.store(true);
        }
      }
    }
    return done.get();
  }

  std::atomic<bool> interrupted{false};

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: it runs loop() from the constructor on
};

class Engine;

// One request streamed step by step (LLM.stream); holds the engine until it is finished or
// closed.
class Stream {
 public:
  Stream(Engine* engine, uint64_t id) : engine_(engine), id_(id) {}
  ~Stream();
  // The request's next output (text delta, new tokens, finished ...); None after the last.
  py::object next();
  void close();

 private:
  Engine* engine_;
  uint64_t id_;
  bool done_ = false;
};

class Engine {
 public:
  Engine(const std::string& model, const py::dict& options, const std::string& address,
         const std::string& token, const std::string& binary) {
    EngineArgs args = engine_args(model, options);
    args.address = address;
    args.cluster_token = token;
    args.tessera_binary = binary;
    Expected<std::unique_ptr<LLM>> llm =
        thread_.call([&]() { return LLM::open(args, "tessera (python)"); });
    if (PyErr_Occurred() != nullptr) {
      // Ctrl-C while loading: the actors go with the LLM, on its thread.
      if (llm) thread_.call([&] { llm->reset(); });
      throw py::error_already_set();
    }
    llm_ = unwrap(std::move(llm));
    std::atomic<bool>* interrupted = &thread_.interrupted;
    llm_->set_interrupt([interrupted]() -> Status {
      if (interrupted->load()) return internal_error("interrupted");
      return Status::ok();
    });
  }
  ~Engine() {
    try {
      close();
    } catch (...) {
    }
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Stops the actors (and the local node the LLM started, if any).
  void close() {
    if (!llm_) return;
    thread_.call([this] { llm_.reset(); });
  }

  LLM& llm() {
    if (!llm_) throw std::runtime_error("this LLM is closed");
    return *llm_;
  }

  // Each prompt n times (its SamplingParams'), the results flat in prompt order. on_finish(i)
  // is called for each request as it finishes (progress bars).
  py::list generate(const std::vector<std::vector<int32_t>>& prompts,
                    const std::vector<PySamplingParams>& params, const py::object& on_finish) {
    if (params.size() != prompts.size()) {
      throw py::value_error("sampling_params: " + std::to_string(params.size()) + " given for " +
                            std::to_string(prompts.size()) + " prompts");
    }
    std::vector<Request> requests;
    for (size_t i = 0; i < prompts.size(); ++i) {
      Request r = unwrap(Request::make(prompts[i], params[i], llm().session().model()));
      for (int c = 0; c < params[i].n; ++c) {
        const bool reseed = params[i].seed && params[i].n > 1;
        requests.push_back(reseed ? r.with_seed(*params[i].seed + static_cast<uint64_t>(c)) : r);
      }
    }
    std::function<void(size_t, const RequestOutput&)> report;
    std::optional<py::error_already_set> raised;
    if (!on_finish.is_none()) {
      report = [this, &on_finish, &raised](size_t i, const RequestOutput& out) {
        if (!out.finished) return;
        py::gil_scoped_acquire gil;
        if (raised) return;
        try {
          on_finish(i);
        } catch (py::error_already_set& e) {
          raised.emplace(std::move(e));  // raised in the caller; the call stops
          thread_.interrupted.store(true);
        }
      };
    }
    Expected<std::vector<GenerationResult>> results =
        run([&] { return llm().generate(std::move(requests), report); });
    if (raised) {
      raised->restore();
      throw py::error_already_set();
    }
    py::list out;
    for (const GenerationResult& r : unwrap(std::move(results))) out.append(result_dict(r));
    return out;
  }

  std::unique_ptr<Stream> stream(const std::vector<int32_t>& prompt,
                                 const PySamplingParams& params) {
    if (params.n != 1) throw py::value_error("stream: n must be 1 (one request is streamed)");
    Request r = unwrap(Request::make(prompt, params, llm().session().model()));
    auto id = run([&] { return llm().session().engine().add_request(std::move(r)); });
    streaming_ = true;
    return std::make_unique<Stream>(this, unwrap(std::move(id)));
  }

  // Steps the engine until request `id` has an output (Ctrl-C aborts the request).
  Expected<RequestOutput> step_until(uint64_t id) {
    return run(
        [&]() -> Expected<RequestOutput> {
          LlmEngine& engine = llm().session().engine();
          while (engine.has_unfinished()) {
            if (thread_.interrupted.load()) {
              engine.abort_request(id);
              return internal_error("interrupted");
            }
            TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
            for (RequestOutput& out : outs) {
              if (out.request_id == id) return std::move(out);
            }
          }
          return internal_error("stream: the engine has no output for request " +
                                std::to_string(id));
        },
        /*from_stream=*/true);
  }

  void end_stream(uint64_t id, bool abort) {
    if (abort && llm_) {
      run([&] { return llm_->session().engine().abort_request(id).has_value(); }, true);
    }
    streaming_ = false;
  }

  // ---- the tokenizer and the chat template

  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) {
    return llm().session().tokenizer().encode(text, add_special_tokens);
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) {
    return llm().session().tokenizer().decode(ids, skip_special_tokens);
  }

  // The chat template's rendering of `messages` (JSON text, so the caller's key order is the
  // order tojson prints); extra: the template's other variables (tools, chat_template_kwargs).
  std::string render_chat(const std::string& messages, bool add_generation_prompt,
                          const std::string& extra, const std::string& chat_template) {
    const ModelSession& s = llm().session();
    auto loaded = unwrap(load_chat_template(chat_template, s.plan().engine.model, s.tokenizer()));
    if (!loaded) {
      throw py::value_error(
          "the model has no chat template: pass chat_template= (a file or the template)");
    }
    auto parse = [](const std::string& text, const char* what) {
      try {
        return nlohmann::ordered_json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        throw py::value_error(std::string(what) + ": " + e.what());
      }
    };
    return unwrap(loaded->render_json(parse(messages, "messages"), add_generation_prompt,
                                      parse(extra, "chat template variables")));
  }

  py::dict info() {
    const ModelSession& s = llm().session();
    const ModelInfo& m = llm().session().model();
    py::dict d;
    d["model"] = s.plan().engine.model;
    d["architecture"] = m.architecture;
    d["backend"] = m.backend;
    d["device_name"] = m.device_name;
    d["dtype"] = m.dtype;
    d["quantization"] = m.quantization;
    d["kv_cache_dtype"] = m.kv_cache_dtype;
    d["vocab_size"] = m.vocab_size;
    d["max_model_len"] = m.max_model_len;
    d["tensor_parallel_size"] = s.plan().engine.tp();
    d["pipeline_parallel_size"] = s.plan().engine.pp();
    d["plan"] = plan_summary(s.plan());
    d["load_seconds"] = s.load_seconds();
    const Tokenizer& t = s.tokenizer();
    d["bos_token_id"] = t.bos_id() ? py::cast(*t.bos_id()) : py::object(py::none());
    d["eos_token_ids"] = t.eos_ids();
    d["tokenizer_vocab_size"] = t.vocab_size();
    return d;
  }

 private:
  // `work` on the engine thread; refused while a stream holds the engine (unless it is that
  // stream's). A signal that came meanwhile is raised (KeyboardInterrupt).
  template <typename F>
  auto run(F&& work, bool from_stream = false) -> decltype(work()) {
    if (streaming_ && !from_stream) {
      throw std::runtime_error(
          "a stream of this LLM is still open: read it to the end or close() it first");
    }
    auto result = thread_.call(std::forward<F>(work));
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    return result;
  }

  EngineThread thread_;
  std::unique_ptr<LLM> llm_;  // made, used and destroyed on thread_
  bool streaming_ = false;
};

Stream::~Stream() {
  try {
    close();
  } catch (...) {
  }
}

py::object Stream::next() {
  if (done_) return py::none();
  Expected<RequestOutput> out = [&] {
    try {
      return engine_->step_until(id_);
    } catch (...) {
      done_ = true;  // Ctrl-C: step_until aborted the request
      engine_->end_stream(id_, /*abort=*/false);
      throw;
    }
  }();
  if (!out || out->finish_reason == FinishReason::kError) {
    done_ = true;
    engine_->end_stream(id_, /*abort=*/!out);
    raise(out ? out->error : out.status());
  }
  if (out->finished) {
    done_ = true;
    engine_->end_stream(id_, /*abort=*/false);
  }
  return output_dict(*out);
}

void Stream::close() {
  if (done_) return;
  done_ = true;
  engine_->end_stream(id_, /*abort=*/true);
}

// ---- the cluster: a local node, a head's status, the token

class Node {
 public:
  explicit Node(const std::string& binary) {
    Expected<std::unique_ptr<LocalNode>> node = [&] {
      py::gil_scoped_release release;
      return LocalNode::start(binary);
    }();
    node_ = unwrap(std::move(node));
  }
  void stop() {
    py::gil_scoped_release release;
    node_.reset();
  }
  std::string address() const { return node_ ? node_->address() : ""; }
  std::string token() const { return node_ ? node_->token() : ""; }

 private:
  std::unique_ptr<LocalNode> node_;
};

std::string cluster_status(const std::string& address, const std::string& token) {
  // On a thread of its own: this thread may hold an LLM's event loop (kj allows one per thread).
  Expected<ClusterStatus> status = internal_error("cluster_status did not run");
  {
    py::gil_scoped_release release;
    std::thread([&] {
      EventLoop loop;
      status = collect_status(loop, address, token);
    }).join();
  }
  return render_status_json(unwrap(std::move(status)));
}

std::string resolve_token(const std::string& cluster_token_file) {
  auto root = find_cluster_root("");
  return unwrap(auth::resolve_cluster_token(cluster_token_file, root ? *root : std::string()));
}

void bind_sampling_params(py::module_& m) {
  const PySamplingParams d;
  py::class_<PySamplingParams>(m, "_SamplingParams")
      .def(py::init([](int n, float temperature, float top_p, int top_k, float min_p,
                       std::optional<uint64_t> seed, float repetition_penalty,
                       float presence_penalty, float frequency_penalty, std::optional<int> logprobs,
                       int max_tokens, bool ignore_eos, std::vector<int32_t> stop_token_ids,
                       const py::object& stop, bool skip_special_tokens) {
             PySamplingParams p;
             p.n = n;
             p.temperature = temperature;
             p.top_p = top_p;
             p.top_k = top_k;
             p.min_p = min_p;
             p.seed = seed;
             p.repetition_penalty = repetition_penalty;
             p.presence_penalty = presence_penalty;
             p.frequency_penalty = frequency_penalty;
             p.logprobs = logprobs.value_or(-1);
             p.max_tokens = max_tokens;
             p.ignore_eos = ignore_eos;
             p.stop_token_ids = std::move(stop_token_ids);
             p.stop = stop_list(stop);
             p.skip_special_tokens = skip_special_tokens;
             p.check();
             return p;
           }),
           py::kw_only(), py::arg("n") = d.n, py::arg("temperature") = d.temperature,
           py::arg("top_p") = d.top_p, py::arg("top_k") = d.top_k, py::arg("min_p") = d.min_p,
           py::arg("seed") = py::none(), py::arg("repetition_penalty") = d.repetition_penalty,
           py::arg("presence_penalty") = d.presence_penalty,
           py::arg("frequency_penalty") = d.frequency_penalty, py::arg("logprobs") = py::none(),
           py::arg("max_tokens") = d.max_tokens, py::arg("ignore_eos") = d.ignore_eos,
           py::arg("stop_token_ids") = d.stop_token_ids, py::arg("stop") = py::none(),
           py::arg("skip_special_tokens") = d.skip_special_tokens)
      .def_readonly("n", &PySamplingParams::n)
      .def_readonly("temperature", &PySamplingParams::temperature)
      .def_readonly("top_p", &PySamplingParams::top_p)
      .def_readonly("top_k", &PySamplingParams::top_k)
      .def_readonly("min_p", &PySamplingParams::min_p)
      .def_readonly("seed", &PySamplingParams::seed)
      .def_readonly("repetition_penalty", &PySamplingParams::repetition_penalty)
      .def_readonly("presence_penalty", &PySamplingParams::presence_penalty)
      .def_readonly("frequency_penalty", &PySamplingParams::frequency_penalty)
      .def_property_readonly("logprobs",
                             [](const PySamplingParams& p) -> std::optional<int> {
                               if (p.logprobs < 0) return std::nullopt;
                               return p.logprobs;
                             })
      .def_readonly("max_tokens", &PySamplingParams::max_tokens)
      .def_readonly("ignore_eos", &PySamplingParams::ignore_eos)
      .def_readonly("stop_token_ids", &PySamplingParams::stop_token_ids)
      .def_readonly("stop", &PySamplingParams::stop)
      .def_readonly("skip_special_tokens", &PySamplingParams::skip_special_tokens);
}

void bind_engine(py::module_& m) {
  py::class_<Stream>(m, "_Stream").def("next", &Stream::next).def("close", &Stream::close);
  py::class_<Engine>(m, "_Engine")
      .def(py::init<const std::string&, const py::dict&, const std::string&, const std::string&,
                    const std::string&>(),
           py::arg("model"), py::arg("options"), py::arg("address"), py::arg("token"),
           py::arg("binary"))
      .def("generate", &Engine::generate, py::arg("prompts"), py::arg("params"),
           py::arg("on_finish"))
      // A stream keeps its engine alive.
      .def("stream", &Engine::stream, py::arg("prompt"), py::arg("params"), py::keep_alive<0, 1>())
      .def("encode", &Engine::encode, py::arg("text"), py::arg("add_special_tokens"))
      .def("decode", &Engine::decode, py::arg("ids"), py::arg("skip_special_tokens"))
      .def("render_chat", &Engine::render_chat, py::arg("messages"),
           py::arg("add_generation_prompt"), py::arg("extra"), py::arg("chat_template"))
      .def("info", &Engine::info)
      .def("close", &Engine::close);
  py::class_<Node>(m, "_Node")
      .def(py::init<const std::string&>(), py::arg("binary"))
      .def("stop", &Node::stop)
      .def_property_readonly("address", &Node::address)
      .def_property_readonly("token", &Node::token);
}

}  // namespace
}  // namespace tessera::python

PYBIND11_MODULE(_tessera, m) {
  using namespace tessera::python;
  m.doc() = "Tessera's C++ driver library (use the tessera package, not this module)";
  // The driver's log lines go to stderr, as the CLI's do (stdout is the script's own);
  // $TESSERA_LOG_LEVEL sets the level.
  if (tessera::Status st = tessera::init_logging({"python", "", ""}); !st) {
    throw std::runtime_error(st.message());
  }
  m.attr("__version__") = TESSERA_VERSION;
  m.attr("default_binary") = TESSERA_BINARY;
  tessera::python::bind_sampling_params(m);
  tessera::python::bind_engine(m);
  m.def("engine_keywords", [] {
    py::list out;
    for (const EngineKeyword& k : engine_keywords()) {
      out.append(py::make_tuple(k.keyword, k.flag, k.help, k.is_flag));
    }
    return out;
  });
  m.def("engine_args", &engine_args_dict, py::arg("model"), py::arg("options"));
  m.def("cluster_status", &cluster_status, py::arg("address"), py::arg("token"));
  m.def("resolve_token", &resolve_token, py::arg("cluster_token_file"));
}
