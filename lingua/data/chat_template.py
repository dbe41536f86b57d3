"""Chat templates (data.format=chat, lingua/data/chat.py): a conversation -> token ids, and
which of them the assistant writes (the targets).

data.chat.template names a Hugging Face tokenizer_config.json with a `chat_template`,
or a .jinja file. Unset: the tokenizer_config.json (or chat_template.jinja) beside
data.tokenizer.path when data.tokenizer.kind=hf and it has a template, else the built-in one,
    BOS "<|system|>\\n{content}\\n" "<|user|>\\n{content}\\n" "<|assistant|>\\n{content}" EOS ...
one message after another, where BOS and EOS are the tokenizer's ids (not text); the generation
prompt is "<|assistant|>\\n". A Jinja template renders as transformers' apply_chat_template
renders it, and the assistant's turns are found by rendering the conversation a message at a
time: messages[:i] with the generation prompt, then messages[:i+1]; what the second adds is the
assistant's turn (each render must extend the one before, or the template is refused). The texts
of bos_token and eos_token encode as the tokenizer's BOS and EOS ids wherever the template writes
them (tiktoken and the byte tokenizer would otherwise spell them out as text); without a
tokenizer_config.json they are `<s>` and `</s>`, the byte tokenizer's names in its Hugging Face
export (lingua.checkpoint.hf.byte_tokenizer_json).
(BUILTIN_JINJA is the built-in template in Jinja, for exports.)
"""

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from lingua.data.jsonl import BadLine
from lingua.data.tokenizer import Tokenizer, TokenizerArgs
from lingua.errors import ConfigError

BUILTIN = "the built-in chat template"
# The built-in template in Jinja, for a tokenizer_config.json beside an export: BOS, then
# "<|role|>\n{content}\n" a message, an assistant's closed by EOS instead of "\n".
# tests/test_sft_hf.py checks it renders exactly what ChatTemplate.encode gives.
BUILTIN_JINJA = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

Piece = Tuple[Union[str, int], bool]   # text (or a token id) and whether its tokens count


class ChatTemplate:
    """Renders a conversation into token ids and the mask of the ids the assistant writes."""

    def __init__(self, source: str, jinja_text: Optional[str] = None,
                 special: Optional[Dict[str, str]] = None):
        self.source = source        # the template's file, or BUILTIN
        self.jinja_text = jinja_text    # None: the built-in template (BUILTIN_JINJA in Jinja)
        self.special = {"bos_token": "<s>", "eos_token": "</s>", **(special or {})}
        self.compiled = _compile(jinja_text, source) if jinja_text is not None else None

    @classmethod
    def from_args(cls, data_args) -> "ChatTemplate":
        path = _template_path(data_args)
        if path is None:
            return cls(BUILTIN)
        text, special = _read_template(path, data_args.tokenizer)
        return cls(str(path), text, special)

    def encode(self, messages: List[dict], tokenizer: Tokenizer,
               add_generation_prompt: bool = False) -> Tuple[List[int], List[bool]]:
        """Token ids, and for each whether it is one the assistant writes (a target)."""
        if self.compiled is None:
            pieces = _builtin_pieces(messages, tokenizer, add_generation_prompt)
        else:
            pieces = self._pieces(messages, add_generation_prompt)
        ids, counted = [], []
        for piece, count in pieces:
            piece_ids = [piece] if isinstance(piece, int) else self._encode_text(piece, tokenizer)
            ids += piece_ids
            counted += [count] * len(piece_ids)
        return ids, counted

    def render(self, messages: List[dict], add_generation_prompt: bool = False) -> str:
        """The Jinja template's text (BadLine when the template raises on this conversation)."""
        import jinja2

        try:
            return self.compiled.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except jinja2.TemplateError as err:
            raise BadLine("template_error", f"the chat template {self.source} failed on it: "
                                            f"{err}") from None

    def _pieces(self, messages: List[dict], add_generation_prompt: bool) -> List[Piece]:
        full = self.render(messages, add_generation_prompt)
        pieces, done = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, after = self.render(messages[:i], True), self.render(messages[:i + 1])
            if not (before.startswith(full[:done]) and after.startswith(before)
                    and full.startswith(after)):
                raise ConfigError(
                    f"The chat template {self.source} does not render a conversation as a "
                    f"sequence of turns that each extend the text before (as rendered with "
                    f"messages[:{i}] and the generation prompt, then messages[:{i + 1}]; a "
                    f"template that rewrites earlier turns, such as one dropping old reasoning, "
                    f"does this), so the assistant's tokens cannot be found. Use another "
                    f"template (data.chat.template), or unset it for the built-in one.")
            pieces += [(full[done:len(before)], False), (full[len(before):len(after)], True)]
            done = len(after)
        return pieces + [(full[done:], False)]

    def _encode_text(self, text: str, tokenizer: Tokenizer) -> List[int]:
        specials = {self.special["eos_token"]: tokenizer.eos_id,
                    self.special["bos_token"]: tokenizer.bos_id}
        split = "(" + "|".join(re.escape(s) for s in specials if s) + ")"
        ids = []
        for part in re.split(split, text):
            if part in specials:
                ids.append(specials[part])
            elif part:
                ids += tokenizer.encode(part, add_bos=False, add_eos=False)
        return ids


def _builtin_pieces(messages: List[dict], tokenizer: Tokenizer,
                    add_generation_prompt: bool) -> List[Piece]:
    pieces, text = [(tokenizer.bos_id, False)], ""
    for m in messages:
        text += f"<|{m['role']}|>\n"
        if m["role"] == "assistant":
            pieces += [(text, False), (m["content"], True), (tokenizer.eos_id, True)]
            text = ""
        else:
            text += m["content"] + "\n"
    if add_generation_prompt:
        text += "<|assistant|>\n"
    return pieces + [(text, False)]


def _template_path(data_args) -> Optional[Path]:
    chat, tok = data_args.chat, data_args.tokenizer
    if chat.template:
        path = Path(chat.template)
        if not path.is_file():
            raise ConfigError(f"data.chat.template={chat.template} does not exist. Point it at a "
                              f"Hugging Face tokenizer_config.json with a chat_template, or a "
                              f".jinja file, or unset it for the built-in template.")
        return path
    if tok.kind != "hf" or not tok.path:
        return None
    beside = Path(tok.path).parent
    config = beside / "tokenizer_config.json"
    if config.is_file() and _config_template(config, _read_config(config)) is not None:
        return config
    jinja = beside / "chat_template.jinja"   # where transformers 5 saves it
    return jinja if jinja.is_file() else None


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"The chat template file {path} is not valid JSON ({err}). Point "
                          f"data.chat.template at a tokenizer_config.json or a .jinja "
                          f"file.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"The chat template file {path} is not a JSON object. Point "
                          f"data.chat.template at a tokenizer_config.json or a .jinja file.")
    return config


def _config_template(path: Path, config: dict) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):   # named templates: the default one, as transformers picks
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_template(path: Path, tok: TokenizerArgs) -> Tuple[str, Dict[str, str]]:
    """The template's text and the special tokens' texts it may use (bos_token, eos_token, ...)."""
    if path.suffix == ".jinja":
        beside = Path(tok.path).with_name("tokenizer_config.json") if tok.path else None
        config = _read_config(beside) if beside is not None and beside.is_file() else {}
        return path.read_text(encoding="utf-8"), _special_tokens(config)
    config = _read_config(path)
    text = _config_template(path, config)
    if text is None:
        raise ConfigError(f"The chat template file {path} has no chat_template (a string, or a "
                          f"list with one named \"default\"). Point data.chat.template at a "
                          f"tokenizer_config.json that has one, or a .jinja file, or unset it "
                          f"for the built-in template.")
    return text, _special_tokens(config)


def _special_tokens(config: dict) -> Dict[str, str]:
    """bos_token, eos_token, pad_token, ... of a tokenizer_config.json, as texts; a value may be
    the AddedToken form {"content": ...}."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def _compile(text: str, source: str):
    """The template compiled as transformers compiles chat templates (sandboxed, trim_blocks,
    lstrip_blocks, its tojson and raise_exception), so it renders the same text."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"The chat template {source} is not valid Jinja: {err} (line "
                          f"{err.lineno} of the template). Fix it, or unset data.chat.template "
                          f"for the built-in one.") from None
