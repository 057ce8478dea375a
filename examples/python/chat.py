"""Chat: the model's chat template renders each conversation, as vLLM's LLM.chat does.

    python3 examples/python/chat.py --model /models/Llama-3.1-8B-Instruct
"""

import argparse

from tessera import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    args = parser.parse_args()

    llm = LLM(model=args.model)
    params = SamplingParams(temperature=0.5, max_tokens=64)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, params, use_tqdm=False)
    print(f"Prompt: {outputs[0].prompt!r}")
    print(f"Generated text: {outputs[0].outputs[0].text!r}")

    # Several conversations in one call are batched together.
    conversations = [conversation, [{"role": "user", "content": "Name three colours."}]]
    for output in llm.chat(conversations, params):
        print(f"Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
