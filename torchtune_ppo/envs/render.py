"""An environment's observation as the tokens appended to a conversation, tokenized once.

The history of an episode is never re-tokenized: after an assistant turn that ended with its
stop token, the rollout appends :meth:`ObservationRenderer.tokens` of the observation, which
close the assistant turn as the chat template does, hold the tool turn, and open the next
assistant turn. The text around the observation comes from the chat template itself (rendered
once on a sentinel conversation) or from a plain template given in the config.
"""

from typing import Any, List, Optional, Tuple

__all__ = ["ObservationRenderer"]

TEMPLATE_KEY = "turns.observation_template"
# Stand-ins for the contents of the sentinel conversation, found again in the rendered text.
_SENT_A = "\u2063SENTINEL_ASSISTANT\u2063"
_SENT_O = "\u2063SENTINEL_OBSERVATION\u2063"


def _template_parts(template: Any) -> Tuple[str, str]:
    """The text before and after ``{observation}`` in a ``str.format`` template."""
    must = (f"{TEMPLATE_KEY}={template!r}: must be a string with {{observation}} exactly once, e.g. "
            "'={observation}' or '\\n<|im_start|>tool\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n'")
    if not isinstance(template, str) or template.count("{observation}") != 1:
        raise ValueError(must + ".")
    try:
        text = template.format(observation=_SENT_O)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{must}, and no other field (write a literal brace doubled: {{{{ or }}}}); "
                         f"{type(e).__name__}: {e}") from None
    if text.count(_SENT_O) != 1:  # '{{observation}}' is a literal, not the field
        raise ValueError(must + ".")
    before, after = text.split(_SENT_O)
    return before, after


def _stop_texts(tokenizer: Any) -> List[str]:
    """The text of each of the tokenizer's stop tokens (e.g. ``<|im_end|>``), longest first."""
    ids = list(getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id])
    texts = {tokenizer.decode([i], skip_special_tokens=False) for i in ids}
    return sorted((t for t in texts if t), key=len, reverse=True)


def _chat_template_parts(tokenizer: Any, role: str) -> Tuple[str, str]:
    """The chat template's text between an assistant turn's stop token and a ``role`` turn's
    content, and from that content to the next assistant turn's first token."""
    chat = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _SENT_A},
            {"role": role, "content": _SENT_O}]
    fix = f"set {TEMPLATE_KEY} to the text of a {role} turn around {{observation}} instead."
    try:
        text = tokenizer.render(chat, add_generation_prompt=True)
    except Exception as e:
        raise ValueError(f"the tokenizer's chat template cannot render a {role!r} turn after an assistant "
                         f"turn ({type(e).__name__}: {e}); {fix}") from None
    if text.count(_SENT_A) != 1 or text.count(_SENT_O) != 1:
        raise ValueError(f"the tokenizer's chat template does not render the assistant's and the {role!r} "
                         f"turn's contents once each as written; {fix}")
    rest = text.split(_SENT_A)[1]
    # The sampled turn already ends with its stop token: what follows the content in the
    # template starts with that token's text, which is left out here.
    stop = next((t for t in _stop_texts(tokenizer) if rest.startswith(t)), None)
    if stop is None:
        raise ValueError(f"the tokenizer's chat template does not end an assistant turn with a stop token "
                         f"({_stop_texts(tokenizer)}) but with {rest[:20]!r}; {fix}")
    before, after = rest[len(stop):].split(_SENT_O)
    return before, after


class ObservationRenderer:
    """Token ids that follow an assistant turn (ended with its stop token) with an observation.

    With ``template``: its text with ``{observation}`` replaced, tokenized with no BOS or EOS,
    e.g. ``"={observation}"`` for a model with no chat template. Without: the tokenizer's chat
    template (``tokenizer.render``, as :class:`~torchtune_ppo.models.HFChatTokenizer` has),
    rendered once on ``[user, assistant, role]`` with the generation prompt; the text after the
    assistant's content, less its stop token, split around the ``role`` turn's content. For
    SmolLM2's ChatML, ``tokens("579")`` is the tokenization of
    ``"\\n<|im_start|>tool\\n579<|im_end|>\\n<|im_start|>assistant\\n"``: the same ids as the
    template's rendering of the whole conversation, since the text starts after a special token.

    Args:
        tokenizer (Any): with ``encode(text, add_bos=..., add_eos=...)``; with ``render`` and
            ``stop_tokens`` (or ``eos_id``) when ``template`` is None.
        template (Optional[str]): the config's ``turns.observation_template``. Default: None
        role (str): the observation turn's role in the chat template. Default: ``"tool"``

    Attributes:
        before (str): the text before the observation.
        after (str): the text after it, up to the next assistant turn's content.

    Raises:
        ValueError: a template without ``{observation}`` once, or other fields; no template
            and no ``render`` on the tokenizer; a chat template that cannot render a ``role``
            turn after an assistant turn, or does not end the assistant turn with a stop token.
    """

    def __init__(self, tokenizer: Any, template: Optional[str] = None, role: str = "tool"):
        self.tokenizer = tokenizer
        self.role = role
        if template is not None:
            self.before, self.after = _template_parts(template)
        elif callable(getattr(tokenizer, "render", None)):
            self.before, self.after = _chat_template_parts(tokenizer, role)
        else:
            raise ValueError(f"{type(tokenizer).__name__} has no chat template to render observations with "
                             f"(no render method): set {TEMPLATE_KEY}, a string with {{observation}} once, "
                             "e.g. '={observation}'.")

    def text(self, observation: str) -> str:
        """The text that :meth:`tokens` tokenizes."""
        return self.before + observation + self.after

    def tokens(self, observation: str) -> List[int]:
        """Token ids to append after the assistant turn's stop token: the rest of the assistant
        turn's closing, the observation's turn, and the next assistant turn's generation prompt.

        Args:
            observation (str): the environment's text.

        Returns:
            List[int]: ``[n]`` ids, with no BOS or EOS added.
        """
        return list(self.tokenizer.encode(self.text(observation), add_bos=False, add_eos=False))
