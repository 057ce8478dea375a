"""Offline batch inference: vLLM's examples/offline_inference/basic.py with `vllm` replaced by
`tessera`.

    python3 examples/python/offline_inference.py --model /models/Llama-3.1-8B-Instruct
"""

import argparse

from tessera import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    args = parser.parse_args()

    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32)
    llm = LLM(model=args.model)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
