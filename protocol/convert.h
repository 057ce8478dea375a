// The one place where the value types of common/ meet their Cap'n Proto forms (step.capnp).
// Every field goes both ways; tests/protocol/convert_test.cpp round-trips each of them.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "common/expert_load.h"
#include "common/load_spec.h"
#include "common/sampling_params.h"
#include "common/status.h"
#include "common/step.h"
#include "protocol/step.capnp.h"

namespace tessera {

void to_proto(const SamplingParams& in, proto::SamplingParams::Builder out);
SamplingParams from_proto(proto::SamplingParams::Reader in);

void to_proto(const StepInput& in, proto::StepInput::Builder out);
StepInput from_proto(proto::StepInput::Reader in);

void to_proto(const StepOutput& in, proto::StepOutput::Builder out);
StepOutput from_proto(proto::StepOutput::Reader in);

void to_proto(const RankInfo& in, proto::RankInfo::Builder out);
RankInfo from_proto(proto::RankInfo::Reader in);

void to_proto(const EngineSpec& in, proto::EngineSpec::Builder out);
EngineSpec from_proto(proto::EngineSpec::Reader in);
void to_proto(const LoadSpec& in, proto::LoadSpec::Builder out);
LoadSpec from_proto(proto::LoadSpec::Reader in);

void to_proto(const ExpertLoad& in, proto::ExpertLoad::Builder out);
ExpertLoad from_proto(proto::ExpertLoad::Reader in);
void to_proto(const ModelInfo& in, proto::ModelInfo::Builder out);
ModelInfo from_proto(proto::ModelInfo::Reader in);

// Steps as flat Cap'n Proto messages, for the shared-memory rings between the driver and its
// local actors. Decoding checks the message (size and nesting limits): a corrupt one is
// INVALID_ARGUMENT, never a crash.
std::vector<std::byte> encode(const StepInput& step);
std::vector<std::byte> encode(const StepOutput& output);
Expected<StepInput> decode_step_input(std::span<const std::byte> bytes);
Expected<StepOutput> decode_step_output(std::span<const std::byte> bytes);

}  // namespace tessera
