// The offline API in a whole program, like vLLM's examples/offline_inference/basic.py:
//
//   tessera-example-offline MODEL_DIR [--device cpu|cuda|auto] [--greedy] [-tp N]
//
// Opens the model (an embedded local node; TESSERA_ADDRESS-style clusters take
// EngineArgs::address), generates for four prompts at once and prints each completion.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "driver/llm.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [--device cpu|cuda|auto] [--greedy] [-tp N]\n",
                 argv[0]);
    return 2;
  }
  tessera::EngineArgs args;
  args.model = argv[1];
  tessera::SamplingParams params;
  params.temperature = 0.8f;
  params.top_p = 0.95f;
  params.seed = 0;
  params.max_tokens = 16;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
      auto device = tessera::parse_device(argv[++i]);
      if (!device) {
        std::fprintf(stderr, "%s\n", device.status().message().c_str());
        return 2;
      }
      args.device = *device;
    } else if (std::strcmp(argv[i], "--greedy") == 0) {
      params.temperature = 0.0f;
    } else if (std::strcmp(argv[i], "-tp") == 0 && i + 1 < argc) {
      auto tp = tessera::ParallelSize::parse(argv[++i], "-tp");
      if (!tp) {
        std::fprintf(stderr, "%s\n", tp.status().message().c_str());
        return 2;
      }
      args.tensor_parallel_size = *tp;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  auto llm = tessera::LLM::open(args);
  if (!llm) {
    std::fprintf(stderr, "cannot open %s: %s\n", args.model.c_str(),
                 llm.status().message().c_str());
    return 1;
  }
  const std::vector<std::string> prompts = {"Hello, my name is",
                                            "The president of the United States is",
                                            "The capital of France is", "The future of AI is"};
  auto results = (*llm)->generate(prompts, params);
  if (!results) {
    std::fprintf(stderr, "generate failed: %s\n", results.status().message().c_str());
    return 1;
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::printf("Prompt: \"%s\", Generated text: \"%s\"\n", prompts[i].c_str(),
                (*results)[i].text.c_str());
  }
  return 0;
}
