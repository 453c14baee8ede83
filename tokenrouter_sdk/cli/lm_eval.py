"""lm-evaluation-harness's command line with the ``tokenrouter`` model type registered:

    python -m tokenrouter_sdk.cli.lm_eval --model tokenrouter --model_args policy=rstitch,tau=0.1 \\
        --tasks gsm8k --limit 32

takes exactly ``lm_eval``'s arguments (lm-eval has no plugin entry point for model types), with
two differences: without ``--device`` (or ``--config``) it passes ``--device cpu``, the Router's
own default (lm-eval's default, ``cuda:0``, would stop a CPU machine; ``--device cuda`` or
``device=`` in ``--model_args`` picks a GPU), and after lm-eval's results it prints the routing
of each ``tokenrouter`` model: requests, hop rate, large share, committed tokens and tokens/s."""

from __future__ import annotations

import sys


def device_args(argv: list[str]) -> list[str]:
    """``argv`` (lm-eval's arguments) with ``--device cpu`` added when it runs an evaluation
    (``--model``) and names no device (``--device``) and no config file (``--config``)."""
    names = {a.split("=", 1)[0] for a in argv}
    if "--model" in names and not names & {"--device", "--config", "-h", "--help"}:
        return [*argv, "--device", "cpu"]
    return list(argv)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from ..eval import lm_eval_model  # registers "tokenrouter"

    sys.argv[1:] = device_args(sys.argv[1:])
    with lm_eval_model.collect_models() as made:
        cli_evaluate()
    for lm in made:
        print(
            f"\ntokenrouter routing ({', '.join(lm.router.models)}; hop rate = handoffs per committed token, "
            f"large share = committed tokens by the last model):\n{lm.routing_table()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
