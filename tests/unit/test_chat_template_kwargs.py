"""``chat_template_kwargs``: variables of the chat template (Qwen3's ``enable_thinking``) reach
the template in `Router.encode`, `generate` and `submit`; they are refused where no template
renders the prompt."""

import pytest

from tests.helpers import thinking_tokenizer
from tokenrouter_sdk import Router
from tokenrouter_sdk.policies import RandomRouting


def test_encode_generate_and_submit_pass_the_variables(pair):
    tok = thinking_tokenizer()
    with Router(pair, RandomRouting(p=0.4, seed=1), tokenizer=tok) as r:
        plain = r.encode("Name a planet.")
        off = r.encode("Name a planet.", chat_template_kwargs={"enable_thinking": False})
        assert tok.decode(off[len(plain) :]) == "<think>\n\n</think>\n\n" and off[: len(plain)] == plain
        assert r.encode("Name a planet.", chat_template_kwargs={"enable_thinking": True}) == plain
        msgs = [{"role": "user", "content": "Name a planet."}]
        assert r.encode(msgs, chat_template_kwargs={"enable_thinking": False}) == off
        assert [
            q.prompt_ids for q in r.requests(["Name a planet."], chat_template_kwargs={"enable_thinking": False})
        ] == [off]
        a = r.generate(
            "Name a planet.", max_new_tokens=6, ignore_eos=True, chat_template_kwargs={"enable_thinking": False}
        )
        b = r.generate([off], max_new_tokens=6, ignore_eos=True, keys=[a.key])[0]
        assert a.token_ids == b.token_ids and a.token_models == b.token_models  # the rendered prompt ran
        call = r.submit([msgs], max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
        call.wait(60)
        assert call[0].config.prompt_ids == off


def test_refused_where_no_template_renders(pair):
    with Router(pair, tokenizer=thinking_tokenizer()) as r:
        with pytest.raises(ValueError, match="prompt 1 is encoded as it is"):
            r.generate(["a question", [5, 6, 7]], chat_template_kwargs={"enable_thinking": False})
        with pytest.raises(ValueError, match="rendered with the chat template"):
            r.encode("raw text", chat=False, chat_template_kwargs={"enable_thinking": False})
        with pytest.raises(ValueError, match="set by the Router itself"):
            r.encode("q", chat_template_kwargs={"add_generation_prompt": False})
        with pytest.raises(TypeError, match="dict"):
            r.encode("q", chat_template_kwargs=["enable_thinking"])
