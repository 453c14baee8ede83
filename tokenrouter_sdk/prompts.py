"""Prompts to token ids: a string (with the chat template when the tokenizer has one and the
string does not hold the template's markers yet; else as text, with the tokenizer's special
tokens such as a BOS unless told not to), chat messages, or token ids as they are."""

from __future__ import annotations

from typing import Mapping

_TEMPLATE_RESERVED = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors", "chat_template"}
)


class PromptEncoder:
    """Encodes prompts with one tokenizer (`encode`), as `tokenrouter_sdk.router.Router.encode`
    documents.

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``apply_chat_template``,
            ``chat_template``, ``bos_token_id``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._markers: tuple[str, ...] | None = None

    def markers(self) -> tuple[str, ...]:
        """Special tokens the chat template writes (e.g. ``<|im_start|>``): a string holding one
        of them is already templated."""
        if self._markers is None:
            tok, found = self.tokenizer, ()
            if getattr(tok, "chat_template", None):
                try:
                    shown = tok.apply_chat_template(
                        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
                    )
                    specials = set(getattr(tok, "all_special_tokens", []) or [])
                    specials |= {
                        str(t)
                        for t in getattr(tok, "added_tokens_decoder", {}).values()
                        if getattr(t, "special", False)
                    }
                    found = tuple(sorted(s for s in specials if s and s in shown))
                except Exception:  # noqa: BLE001 - a template that cannot render: no detection
                    found = ()
            self._markers = found
        return self._markers

    def renders(self, prompt, chat: bool | None) -> bool:
        """Whether `encode` renders ``prompt`` with the chat template."""
        if isinstance(prompt, str):
            if chat is None:
                return bool(getattr(self.tokenizer, "chat_template", None)) and not any(
                    m in prompt for m in self.markers()
                )
            return bool(chat)
        return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)

    @staticmethod
    def check_template_kwargs(kwargs) -> dict:
        """``kwargs`` (chat template variables, or None) as a dict.

        Raises:
            TypeError: not a dict.
            ValueError: naming a variable the Router sets itself (``add_generation_prompt``,
                ``tokenize``, ...).
        """
        if kwargs is None:
            return {}
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"chat_template_kwargs must be a dict of template variables, e.g. "
                f"{{'enable_thinking': False}}; got {type(kwargs).__name__}"
            )
        bad = sorted(set(kwargs) & _TEMPLATE_RESERVED)
        if bad:
            raise ValueError(
                f"chat_template_kwargs {bad} are set by the Router itself; pass only the template's "
                f"own variables (e.g. enable_thinking)"
            )
        return dict(kwargs)

    def encode(
        self,
        prompt,
        chat: bool | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Token ids of ``prompt``: the arguments, the rules and the errors are those of
        `tokenrouter_sdk.router.Router.encode`."""
        tok = self.tokenizer
        extra = self.check_template_kwargs(chat_template_kwargs)
        if extra and not self.renders(prompt, chat):
            raise ValueError(
                "chat_template_kwargs apply to prompts rendered with the chat template; this prompt is "
                "encoded as it is (token ids, chat=False, or a string that already holds the "
                "template's markers)"
            )
        if isinstance(prompt, str):
            if not self.renders(prompt, chat):
                ids = tok.encode(prompt, add_special_tokens=bool(add_special_tokens))
                return self._single_bos([int(i) for i in ids])
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, **extra)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return self._single_bos([int(i) for i in ids])
        if isinstance(prompt, (list, tuple)):
            return [int(i) for i in prompt]
        raise TypeError(
            f"a prompt must be a str, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
        )

    def _single_bos(self, ids: list[int]) -> list[int]:
        """``ids`` with one BOS where they begin with two (a text that holds its own BOS encoded
        with the special tokens, or a template that writes one the tokenizer adds again)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
            return ids[1:]
        return ids
