// One rank's model on one device: the forward pass of its pipeline stage over its shard of the
// weights, its paged KV cache, and (on the rank that samples) token sampling. ModelRunner
// (model_runner.h) drives a Backend step by step; the cpu backend (cpu_model.h) and the cuda
// backend (cuda_model.h) implement it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "actors/comm/communicator.h"
#include "actors/model/requests.h"
#include "common/expert_load.h"
#include "common/load_spec.h"
#include "common/sampling_params.h"
#include "common/status.h"

namespace tessera {

// The groups a rank talks to (null when the group has one rank). Not owned: the actor keeps
// them for the model's life.
struct StageComms {
  comm::Communicator* tp = nullptr;  // this stage's tensor-parallel ranks (group rank = tp_rank)
  comm::Communicator* pp = nullptr;  // this column's stages (group rank = pp_rank)
};

class Backend {
 public:
  virtual ~Backend() = default;

  // KV blocks this rank can hold (sized from memory on the GPU; what the spec asks on the CPU).
  virtual int64_t fit_kv_blocks() const = 0;
  // Allocates the KV cache with `blocks` (<= fit_kv_blocks(): the fewest any rank fits) and
  // prepares for steps (the cuda backend captures its graphs here, every rank at once).
  virtual Status init_cache(int64_t blocks) = 0;

  // Starts the batch through this rank's stage; collect() waits for it. The batch was checked
  // when the request table made it (StepBatch, requests.h): the backend checks nothing of it
  // again. At most two launches are outstanding; the second may fill tokens from the first's
  // samples (batch.fills()). With `want_logits` (only with nothing outstanding) collect() hands
  // back the fp32 logits of the rows. An error leaves nothing outstanding for this launch (the
  // one before still is).
  virtual Status launch(const StepBatch& batch, bool want_logits) = 0;
  // Waits for the oldest outstanding launch. On the sampling rank (last stage, tp rank 0)
  // returns one sample per row of it (the rows with want_logits, in order) and, if it asked,
  // appends their logits [rows, vocab] to `logits`; every other rank returns nothing.
  virtual Expected<std::vector<SampleResult>> collect(std::vector<float>* logits) = 0;
  // The oldest outstanding launch has finished (collect() would not wait).
  virtual bool collect_ready() const { return true; }
  // The request is gone: drop any per-request state.
  virtual void forget(uint64_t request_id) { (void)request_id; }

  // Backend, dtype, device, sizes (kv_blocks: allocated once init_cache ran, else what fits).
  virtual ModelInfo info() const = 0;
  // GPU time of the last step's forward pass in microseconds (0 on the cpu backend).
  virtual uint32_t last_gpu_micros() const { return 0; }
  // A count the forward pass advances as it goes, for the actor's watchdog: a step whose count
  // stops moving is stuck (a hung collective, a deadlock), one whose count moves is only long.
  // The cpu backend ticks in every op and inside long ones (kernels/cpu/cpu_context.h), well
  // under a second apart. Any thread. A backend that does not count (0 always, as the cuda
  // backend, whose steps are short) has its steps judged by their length alone.
  virtual uint64_t progress() const { return 0; }
  // The routings this rank counted in its MoE layers since it loaded (empty for a dense model,
  // or a rank that leaves the counting to another). Any thread.
  virtual ExpertLoad expert_load() const { return {}; }
};

}  // namespace tessera
