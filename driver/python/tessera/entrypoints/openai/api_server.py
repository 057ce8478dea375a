"""`python3 -m tessera.entrypoints.openai.api_server --model MODEL ...`: vLLM's server command
with `vllm` replaced by `tessera`; it runs `tessera serve` with the same arguments (--host,
--port, --model, --tensor-parallel-size, --dtype, --quantization, --enable-auto-tool-choice,
--tool-call-parser, ...)."""

import os
import sys

from tessera import _binary


def main() -> None:
    binary = _binary()
    os.execv(binary, [binary, "serve"] + sys.argv[1:])


if __name__ == "__main__":
    main()
