# ruff: noqa: B018
"""Names vulture reports as unused that are used where it does not look (parsed by vulture, never
imported): `vulture tokenrouter_sdk .ci/vulture_whitelist.py --min-confidence 60`."""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# called by a framework by name: IPython display hooks, lm-eval's LM API, Hugging Face evaluate
# metrics (loaded from their folder by path), FastAPI routes (registered by decorator),
# multiprocessing's pickling protocol, io.RawIOBase, module __getattr__ (PEP 562)
_._repr_pretty_
_._repr_html_
_._repr_mimebundle_
_._ipython_display_
_.TokenRouterLM
_.create_from_arg_string
_._loglikelihood_tokens
_.loglikelihood_rolling
_.generate_until
_.get_model_info
_._info
_._compute
_.ChoiceAccuracy
_.MathAccuracy
_.completions
_.chat_completions
_.health
_.tokenizer_info
_.tokenize
_.detokenize
_.duplicate_for_child
_.DupFd
_.writable
_.__getattr__

# typing-only names: Protocols the code is written against, imported under TYPE_CHECKING
_.Transport
_.CallLink

# run from a command string in a child process (`python -c "...; _follower_main()"`)
_._follower_main

# public API, used by users, tests, docs and evals (outside tokenrouter_sdk)
_.wait_compiled
_.demo_prompts
_.active_calls
_.wait_idle
_.static_plot
_.frontier
_.gemma3_270m_folder
_.tiny_model
_.random_head
_.save_query_head
_.load_query_head
_.count_parameters
_.reference_generate
_.reference_logprobs
_.reference_generate_text
_.agenerate
_.astream
