#include "driver/model_session.h"

#include <chrono>

#include "common/session.h"
#include "protocol/auth.h"

namespace tessera {

Status validate(const EngineArgs& a) {
  if (a.model.empty()) return invalid_argument("--model: give a Hugging Face model directory");
  if (a.device != "auto" && a.device != "cuda" && a.device != "cpu") {
    return invalid_argument("--device '" + a.device + "' is not one of auto, cuda, cpu");
  }
  if (a.max_num_seqs < 1 || a.max_num_seqs > 65536) {
    return invalid_argument("--max-num-seqs must be between 1 and 65536, got " +
                            std::to_string(a.max_num_seqs));
  }
  if (!(a.gpu_memory_utilization > 0.0f && a.gpu_memory_utilization <= 1.0f)) {
    return invalid_argument("--gpu-memory-utilization must be in (0, 1], got " +
                            std::to_string(a.gpu_memory_utilization));
  }
  if (a.max_num_batched_tokens != 0 && a.max_num_batched_tokens < 16) {
    return invalid_argument(
        "--max-num-batched-tokens must be at least 16 (or 0 for the "
        "default), got " +
        std::to_string(a.max_num_batched_tokens));
  }
  return Status::ok();
}

namespace {

class TokenizerDetokenizer final : public Detokenizer {
 public:
  explicit TokenizerDetokenizer(const Tokenizer& t) : t_(t) {}
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    return t_.decode(ids, skip_special);
  }

 private:
  const Tokenizer& t_;
};

// For benchmarks: token ids only, no text (vLLM's detokenize=False).
class NoDetokenizer final : public Detokenizer {
 public:
  std::string decode(const std::vector<int32_t>&, bool) const override { return {}; }
};

}  // namespace

ModelSession::~ModelSession() = default;

Expected<std::unique_ptr<ModelSession>> ModelSession::open(const EngineArgs& a,
                                                           const std::string& owner,
                                                           bool detokenize) {
  TESSERA_RETURN_IF_ERROR(validate(a));
  std::unique_ptr<ModelSession> s(new ModelSession());
  TESSERA_ASSIGN_OR_RETURN(s->config_, load_model_config(a.model, &s->defaults_));
  TESSERA_ASSIGN_OR_RETURN(s->tokenizer_, Tokenizer::load(a.model));
  if (a.max_model_len > s->config_.max_position_embeddings) {
    return invalid_argument("--max-model-len " + std::to_string(a.max_model_len) +
                            " exceeds the model's max_position_embeddings (" +
                            std::to_string(s->config_.max_position_embeddings) + ")");
  }
  std::string address = a.address;
  std::string token;
  if (address.empty()) {
    TESSERA_ASSIGN_OR_RETURN(s->local_, LocalNode::start());
    address = s->local_->address();
    token = s->local_->token();
  } else {
    auto root = open_root("");
    TESSERA_ASSIGN_OR_RETURN(
        token, auth::resolve_cluster_token(a.cluster_token_file, root ? *root : std::string()));
  }
  s->loop_ = std::make_unique<EventLoop>();
  TESSERA_ASSIGN_OR_RETURN(s->cluster_, ClusterClient::connect(*s->loop_, address, token));
  NodeHandle node = s->cluster_->head_node();
  TESSERA_ASSIGN_OR_RETURN(NodeView info, node.info());
  TESSERA_ASSIGN_OR_RETURN(s->lease_, node.open_lease(owner));
  SpawnOptions spawn;
  spawn.name = owner;
  if (a.device != "cpu" && !info.resources.gpus.empty()) {
    spawn.gpus = {info.resources.gpus.front().index};
  } else if (a.device == "cuda") {
    return failed_precondition("--device cuda: node " + info.name + " has no GPU");
  }
  TESSERA_ASSIGN_OR_RETURN(ActorView actor, s->lease_->spawn(spawn));
  TESSERA_ASSIGN_OR_RETURN(s->actor_, ActorHandle::connect(*s->loop_, actor.address, actor.key));
  s->executor_ =
      std::make_unique<ActorExecutor>(*s->loop_, *s->actor_, s->lease_.get(), actor.actor_id);

  LoadOptions load;
  load.model_dir = a.model;
  load.dtype = a.dtype;
  load.max_model_len = a.max_model_len;  // 0: the actor's default (resolve_max_model_len)
  load.return_logits = a.return_logits;
  load.device = a.device;
  load.gpu_memory_utilization = a.gpu_memory_utilization;
  load.enforce_eager = a.enforce_eager;
  load.max_num_seqs = a.max_num_seqs;
  load.max_num_batched_tokens = a.max_num_batched_tokens;
  auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(s->model_, s->executor_->load(load));
  s->load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  EngineConfig ec;
  ec.num_blocks = s->model_.kv_blocks;
  ec.block_size = s->model_.block_size;
  ec.scheduler.max_model_len = s->model_.max_model_len;
  ec.scheduler.max_num_seqs = a.max_num_seqs;
  ec.scheduler.max_num_batched_tokens = s->model_.max_num_batched_tokens;  // the actor's budget
  ec.vocab_size = s->model_.vocab_size;
  for (int64_t id : s->config_.eos_token_ids) ec.eos_token_ids.push_back(static_cast<int32_t>(id));
  if (detokenize) {
    s->detokenizer_ = std::make_unique<TokenizerDetokenizer>(*s->tokenizer_);
  } else {
    s->detokenizer_ = std::make_unique<NoDetokenizer>();
  }
  s->engine_ = std::make_unique<LlmEngine>(ec, *s->executor_, *s->detokenizer_);
  return s;
}

}  // namespace tessera
