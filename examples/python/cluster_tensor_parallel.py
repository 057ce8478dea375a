"""Tensor parallelism on a cluster joined by address, as a Ray user writes
`ray.init(address=...)` before `LLM(..., tensor_parallel_size=2)`.

On the head machine:      tessera start --head
On every other machine:   tessera start --address HEAD:6380
Then, anywhere:           python3 examples/python/cluster_tensor_parallel.py \\
                              --address HEAD:6380 --model /models/Llama-3.1-8B-Instruct
(the cluster token: --cluster-token-file, $TESSERA_CLUSTER_TOKEN, or the head's on its machine)
"""

import argparse

import tessera
from tessera import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--address", default=None, help="the head's HOST:PORT "
                        "(default: $TESSERA_ADDRESS)")
    parser.add_argument("--cluster-token-file", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    args = parser.parse_args()

    tessera.init(address=args.address, cluster_token_file=args.cluster_token_file)
    for node in tessera.nodes():
        print(f"node {node['NodeManagerHostname']} at {node['Address']}: {node['Resources']}")
    print(f"cluster: {tessera.cluster_resources()}")

    llm = LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size)
    print(llm.model_info["plan"], end="")
    outputs = llm.generate(["The capital of France is", "The largest planet is"],
                           SamplingParams(temperature=0, max_tokens=16))
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    tessera.shutdown()


if __name__ == "__main__":
    main()
