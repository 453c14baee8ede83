"""lm-evaluation-harness's command line with the ``tokenrouter`` model type registered:

    python -m tokenrouter_sdk.cli.lm_eval --model tokenrouter --model_args policy=rstitch,tau=0.1 \\
        --tasks gsm8k --limit 32

takes exactly ``lm_eval``'s arguments (lm-eval has no plugin entry point for model types)."""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from ..eval import lm_eval_model  # noqa: F401 - registers "tokenrouter"
    cli_evaluate()


if __name__ == "__main__":
    main()
