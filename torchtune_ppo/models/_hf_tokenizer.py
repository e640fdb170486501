"""A torchtune model tokenizer for any Hugging Face ``tokenizer.json`` with a chat template.

torchtune 0.6.1 can read a ``tokenizer.json`` (``HuggingFaceBaseTokenizer``: encode / decode
and the BOS / EOS ids) but has no model tokenizer around it: nothing turns torchtune
``Message``s into the model's chat format. :class:`HFChatTokenizer` does, by rendering the
model's own Jinja chat template (``tokenizer_config.json``'s ``chat_template``) the way
transformers' ``apply_chat_template`` does, so the ids are the ones transformers would give
and the model was trained on, including any default system prompt the template inserts.

:func:`render_chat_prompt` is the plain entry point for prompt datasets: a list of
``{"role", "content"}`` dicts (and an optional system prompt) to the ids of a prompt that
ends in the assistant header.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchtune.data import Message
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer, ModelTokenizer

from torchtune_ppo._patches.torchtune_modules import truncate

__all__ = ["HFChatTokenizer", "render_chat_prompt"]

# Appended to the final message to find where its content ends in the rendered text (what
# transformers' continue_final_message does); it cannot occur in real text by accident.
_CONTINUE_TAG = "\u2063CONTINUE_FINAL_MESSAGE\u2063"


def _compile_chat_template(template: str):
    """Compile a chat template in the environment transformers renders chat templates in.

    A sandbox with ``trim_blocks`` and ``lstrip_blocks`` (they change the whitespace of most
    templates), the ``loopcontrols`` extension, transformers' ``tojson`` (no HTML escaping,
    non-ASCII kept), ``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks
    (which only mark assistant spans for transformers) rendered as their body.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json writes a special token as "<s>" or as {"content": "<s>", ...}.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFChatTokenizer(ModelTokenizer, Transform):
    """torchtune model tokenizer over a Hugging Face ``tokenizer.json`` and its chat template.

    Encoding and decoding are torchtune's ``HuggingFaceBaseTokenizer`` (the ``tokenizers``
    library on ``tokenizer.json``); :meth:`tokenize_messages` renders the conversation with the
    chat template of ``tokenizer_config.json``, as ``apply_chat_template`` does, and tokenizes
    the text in one piece with no extra special tokens. As a ``Transform`` it maps a sample's
    ``"messages"`` to ``"tokens"`` and ``"mask"``, so torchtune's chat / instruct datasets and
    message transforms accept it.

    Args:
        tokenizer_json_path (str): ``tokenizer.json``.
        tokenizer_config_json_path (str): ``tokenizer_config.json``, with ``chat_template`` and
            the ``bos_token`` / ``eos_token`` (and ``pad_token``) strings.
        generation_config_path (Optional[str]): ``generation_config.json``; its
            ``eos_token_id`` (an int or a list) join the stop tokens.
        max_seq_len (Optional[int]): :meth:`tokenize_messages` truncates to this many tokens.
        pad_token (Optional[str]): the padding token; the config's ``pad_token`` if None.
        stop_tokens (Optional[Sequence[str]]): tokens that end a response, besides ``eos``
            and the generation config's EOS ids.

    Raises:
        ValueError: no chat template, an unknown pad or stop token, or a pad token that is
            also a stop token (this project's recipe fills responses with ``pad_id`` after
            their stop token, so the two must differ).
    """

    def __init__(
        self,
        tokenizer_json_path: str,
        *,
        tokenizer_config_json_path: str,
        generation_config_path: Optional[str] = None,
        max_seq_len: Optional[int] = None,
        pad_token: Optional[str] = None,
        stop_tokens: Optional[Sequence[str]] = None,
    ):
        self.base = HuggingFaceBaseTokenizer(
            tokenizer_json_path,
            tokenizer_config_json_path=tokenizer_config_json_path,
            generation_config_path=generation_config_path,
        )
        self.max_seq_len = max_seq_len
        self.bos_id: int = self.base.bos_id
        self.eos_id: int = self.base.eos_id
        config = self.base.config or {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{tokenizer_config_json_path} has no chat_template.")
        self.chat_template: str = template
        self._template = _compile_chat_template(template)

        # What apply_chat_template passes to the template besides the messages.
        self._template_vars: Dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            text = _token_text(config.get(key))
            if text is not None:
                self._template_vars[key] = text
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        if extra:
            self._template_vars["additional_special_tokens"] = [t for t in extra if t is not None]

        hf = self.base.tokenizer
        self.special_tokens: Dict[str, int] = {
            tok.content: idx for idx, tok in sorted(hf.get_added_tokens_decoder().items()) if tok.special
        }
        self.vocab_size: int = hf.get_vocab_size()

        stops = [self.eos_id]
        gen_eos = (self.base.generation_config or {}).get("eos_token_id")
        stops += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        stops += [self._id_of(t, "stop token") for t in stop_tokens or ()]
        self.stop_tokens: List[int] = list(dict.fromkeys(int(t) for t in stops))

        pad_text = pad_token if pad_token is not None else _token_text(config.get("pad_token"))
        if pad_text is None:
            raise ValueError(f"{tokenizer_config_json_path} has no pad_token; pass pad_token=...")
        self.pad_id: int = self._id_of(pad_text, "pad_token")
        if self.pad_id in self.stop_tokens:
            raise ValueError(
                f"pad_token {pad_text!r} (id {self.pad_id}) is also a stop token {self.stop_tokens}: "
                "responses are filled with pad_id after their stop token, so pass a pad_token "
                "that the model never needs to generate (an unused special token)."
            )

    def _id_of(self, token: str, what: str) -> int:
        idx = self.base.tokenizer.token_to_id(token)
        if idx is None:
            raise ValueError(f"{what} {token!r} is not in the vocabulary.")
        return idx

    # ------------------------------------------------------------------ plain text

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **kwargs: Any) -> List[int]:
        """Token ids of ``text``, optionally with ``bos_id`` first and ``eos_id`` last.

        Args:
            text (str): the text; special tokens written in it (``<|im_start|>``) become
                their ids.
            add_bos (bool): prepend ``bos_id``. Default: True (torchtune's convention)
            add_eos (bool): append ``eos_id``. Default: True
            **kwargs (Any): accepted and ignored (e.g. ``trim_leading_whitespace``, which
                torchtune passes to SentencePiece tokenizers).

        Returns:
            List[int]: the ids.
        """
        return self.base.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``.

        Args:
            token_ids (List[int]): the ids.
            skip_special_tokens (bool): leave out special tokens (pad, ``<|im_end|>``, ...).
                Default: True

        Returns:
            str: the text.
        """
        return self.base.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def render(self, chat: List[Dict[str, str]], *, add_generation_prompt: bool = False,
               continue_final_message: bool = False) -> str:
        """The chat template applied to ``chat``, as text (``apply_chat_template(tokenize=False)``).

        Args:
            chat (List[Dict[str, str]]): ``{"role": ..., "content": ...}`` messages.
            add_generation_prompt (bool): end with the header of an assistant turn.
            continue_final_message (bool): end right after the last message's content, leaving
                that turn open (to be continued by the model), as transformers does.

        Returns:
            str: the rendered conversation.
        """
        if continue_final_message:
            if not chat:
                raise ValueError("continue_final_message needs a final message to continue.")
            final = chat[-1]["content"]
            chat = [*chat[:-1], {**chat[-1], "content": final + _CONTINUE_TAG}]
        text = self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **self._template_vars)
        if continue_final_message:
            at = text.rfind(_CONTINUE_TAG)
            if at < 0:
                raise ValueError("the chat template dropped the final message's content; cannot continue it.")
            text = text[:at]
        return text

    def tokenize_messages(
        self, messages: List[Message], *, add_end_tokens: bool = True
    ) -> Tuple[List[int], List[bool]]:
        """Token ids of a conversation in the model's chat format, and the loss mask.

        The text is the chat template's, rendered with ``add_generation_prompt=True`` when the
        last message is not the assistant's (a prompt); a final assistant message is closed as
        the template closes turns when ``add_end_tokens`` (training), and left open after its
        content otherwise (inference continues it). ``eos_id`` is appended only when the
        template did not already end the final assistant turn with it. torchtune's
        ``ipython`` role is passed to the template as ``tool``.

        Each token's mask is its message's ``masked`` (True: no loss on it); text the template
        adds before a message (a default system prompt, headers) belongs to that message, the
        generation prompt to the last one.

        Args:
            messages (List[Message]): the conversation; text content only.
            add_end_tokens (bool): close a final assistant turn. Default: True

        Returns:
            Tuple[List[int], List[bool]]: ``tokens [n]`` and ``mask [n]``, truncated to
            ``max_seq_len`` when set.

        Raises:
            ValueError: a message with non-text content, or a template whose rendering of a
                conversation does not start with its rendering of the conversation's start
                (the mask could not be attributed).
        """
        if not messages:
            return [], []
        chat = []
        for m in messages:
            if any(item["type"] != "text" for item in m.content):
                raise ValueError(f"HFChatTokenizer handles text only; a {m.role} message has other content.")
            chat.append({"role": "tool" if m.role == "ipython" else m.role, "content": m.text_content})
        last_is_assistant = messages[-1].role == "assistant"
        text = self.render(
            chat,
            add_generation_prompt=not last_is_assistant,
            continue_final_message=last_is_assistant and not add_end_tokens,
        )
        # Where each message's text ends: the rendering of the conversation up to it.
        ends = []
        for i in range(1, len(chat)):
            prefix = self.render(chat[:i])
            if not text.startswith(prefix):
                raise ValueError(
                    "the chat template renders a conversation differently from its first messages; "
                    "per-message masks cannot be attributed."
                )
            ends.append(len(prefix))
        ends.append(len(text))

        encoding = self.base.tokenizer.encode(text, add_special_tokens=False)
        tokens, owner, i = list(encoding.ids), [], 0
        for start, _ in encoding.offsets:  # a token belongs to the message its first char is in
            while i < len(ends) - 1 and start >= ends[i]:
                i += 1
            owner.append(i)
        mask = [messages[o].masked for o in owner]
        final = [t for t, o in zip(tokens, owner) if o == len(messages) - 1]
        if add_end_tokens and last_is_assistant and self.eos_id not in final:
            tokens.append(self.eos_id)
            mask.append(messages[-1].masked)
        if self.max_seq_len:
            eos = self.eos_id if add_end_tokens else None
            tokens = truncate(tokens, self.max_seq_len, eos)
            mask = truncate(mask, self.max_seq_len, True if add_end_tokens else None)
        return tokens, mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        """Replace ``sample["messages"]`` with ``"tokens"`` and ``"mask"`` (torchtune's Transform).

        Args:
            sample (Mapping[str, Any]): with a ``"messages"`` list of ``Message``.
            inference (bool): leave a final assistant turn open. Default: False

        Returns:
            Mapping[str, Any]: the sample.
        """
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample

    def render_chat_prompt(self, messages: Sequence[Mapping[str, str]], system: Optional[str] = None) -> List[int]:
        """See :func:`render_chat_prompt`."""
        chat = _prompt_chat(messages, system)
        return self.base.tokenizer.encode(self.render(chat, add_generation_prompt=True), add_special_tokens=False).ids


def _prompt_chat(messages: Sequence[Mapping[str, str]], system: Optional[str]) -> List[Dict[str, str]]:
    chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if not chat:
        raise ValueError("render_chat_prompt needs at least one message.")
    if chat[-1]["role"] == "assistant":
        raise ValueError("render_chat_prompt builds a prompt for the assistant's reply; the last message is "
                         "the assistant's.")
    if system is not None:
        if chat[0]["role"] == "system":
            raise ValueError("both system= and a system message were given; pass one.")
        chat.insert(0, {"role": "system", "content": system})
    return chat


def render_chat_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], system: Optional[str] = None
) -> List[int]:
    """Token ids of a chat prompt that ends in the assistant header, ready to generate from.

    With an :class:`HFChatTokenizer` the ids are exactly transformers'
    ``apply_chat_template(chat, add_generation_prompt=True)``; with ``system=None`` and no
    system message, the template's own default system prompt (if it has one, as SmolLM2's
    does) is used, as in transformers. Any other torchtune model tokenizer (Llama-3,
    Qwen2.5, ...) gets the conversation plus an empty assistant turn left open, which is its
    generation prompt.

    Args:
        tokenizer (Any): an :class:`HFChatTokenizer`, or a torchtune model tokenizer whose
            ``tokenize_messages`` takes ``add_end_tokens`` (Llama-3) or ``add_eos`` (Qwen2).
        messages (Sequence[Mapping[str, str]]): ``{"role": "user" | "assistant" | "system",
            "content": str}`` dicts; the last is not the assistant's.
        system (Optional[str]): a system prompt to put first. Default: None

    Returns:
        List[int]: ``[n]`` prompt ids (no padding).

    Raises:
        ValueError: no messages, a final assistant message, or a system prompt given twice.
    """
    if isinstance(tokenizer, HFChatTokenizer):
        return tokenizer.render_chat_prompt(messages, system)
    chat = _prompt_chat(messages, system)
    msgs = [Message(role=m["role"], content=m["content"]) for m in chat] + [Message(role="assistant", content="")]
    import inspect

    params = inspect.signature(tokenizer.tokenize_messages).parameters
    kwargs = {"add_end_tokens": False} if "add_end_tokens" in params else {"add_eos": False}
    tokens, _ = tokenizer.tokenize_messages(msgs, **kwargs)
    return list(tokens)


def hf_chat_tokenizer(
    path: str,
    max_seq_len: Optional[int] = None,
    pad_token: Optional[str] = None,
    stop_tokens: Optional[Sequence[str]] = None,
) -> HFChatTokenizer:
    """An :class:`HFChatTokenizer` from a Hugging Face model folder.

    Args:
        path (str): folder with ``tokenizer.json`` and ``tokenizer_config.json`` (and
            optionally ``generation_config.json``).
        max_seq_len (Optional[int]): truncation length of ``tokenize_messages``.
        pad_token (Optional[str]): padding token; the folder's ``pad_token`` if None.
        stop_tokens (Optional[Sequence[str]]): extra stop tokens.

    Returns:
        HFChatTokenizer: the tokenizer.
    """
    folder = Path(path).expanduser()
    gen = folder / "generation_config.json"
    return HFChatTokenizer(
        str(folder / "tokenizer.json"),
        tokenizer_config_json_path=str(folder / "tokenizer_config.json"),
        generation_config_path=str(gen) if gen.is_file() else None,
        max_seq_len=max_seq_len,
        pad_token=pad_token,
        stop_tokens=stop_tokens,
    )
