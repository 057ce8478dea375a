"""Streaming one request: each new piece of text as the engine produces it.

    python3 examples/python/streaming.py --model /models/Llama-3.1-8B-Instruct
"""

import argparse
import sys

from tessera import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--prompt", default="Once upon a time")
    args = parser.parse_args()

    llm = LLM(model=args.model)
    shown = 0
    sys.stdout.write(args.prompt)
    for output in llm.stream(args.prompt, SamplingParams(temperature=0.7, max_tokens=48)):
        text = output.outputs[0].text
        sys.stdout.write(text[shown:])  # the outputs are cumulative: print the new part
        sys.stdout.flush()
        shown = len(text)
    print(f"\n[{output.outputs[0].finish_reason}, {len(output.outputs[0].token_ids)} tokens]")


if __name__ == "__main__":
    main()
