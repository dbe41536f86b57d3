"""Chat templates (data.format=chat): a conversation -> token ids, and which of them the assistant
writes (the targets).

data.chat.template names a tokenizer_config.json with a `chat_template`, or a .jinja file. Unset:
the one beside data.tokenizer.path when data.tokenizer.kind=hf and it has a template, else the
built-in one: BOS, then "<|role|>\\n{content}\\n" a message, an assistant's closed by EOS instead
of "\\n"; its generation prompt is "<|assistant|>\\n". A Jinja template renders as transformers'
apply_chat_template does; an assistant's turn is what rendering messages[:i+1] adds to messages[:i]
with the generation prompt, or, where a template rewrites earlier turns (Qwen3 drops their
reasoning), its content in the whole render through the closing it gets as the last turn. The
texts of bos_token and eos_token (`<s>`, `</s>` by default) encode as the BOS and EOS ids.
"""

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from lingua.data.jsonl import BadLine
from lingua.data.tokenizer import Tokenizer, TokenizerArgs
from lingua.data.tokenizer import special_tokens as _special_tokens
from lingua.errors import ConfigError

BUILTIN = "the built-in chat template"
# The built-in template in Jinja, for exports: tests/test_sft_hf.py checks it renders exactly
# what ChatTemplate.encode gives.
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
        self.jinja_text = jinja_text    # None: the built-in template
        self.special = {"bos_token": "<s>", "eos_token": "</s>", **(special or {})}
        if jinja_text is not None:
            _check_syntax(jinja_text, source)

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
        if self.jinja_text is None:
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
        """The text as transformers' apply_chat_template renders it (no Jinja environment of
        ours); BadLine when the template raises on this conversation."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            return render_jinja_template([messages], chat_template=self.jinja_text,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special)[0][0]
        except jinja2.TemplateError as err:
            raise BadLine("template_error", f"the chat template {self.source} failed on it: "
                                            f"{err}") from None

    def _pieces(self, messages: List[dict], add_generation_prompt: bool) -> List[Piece]:
        full = self.render(messages, add_generation_prompt)
        pieces, done, seen = [], 0, 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, after = self.render(messages[:i], True), self.render(messages[:i + 1])
            if before.startswith(full[:done]) and after.startswith(before) and \
                    full.startswith(after):
                start, end = len(before), len(after)
            else:   # the template rewrites earlier turns (Qwen3 drops their <think> blocks)
                start, end = self._turn_in(full, messages[seen:i], message, after, done, i)
            pieces += [(full[done:start], False), (full[start:end], True)]
            done, seen = end, i + 1
        return pieces + [(full[done:], False)]

    def _turn_in(self, full: str, prompt: List[dict], message: dict, alone: str, done: int,
                 i: int) -> Tuple[int, int]:
        """Where assistant turn i lies in `full`: its content, found after the messages before it,
        through the closing its own render (`alone`, where it is the last turn) writes after it."""
        at = done
        for m in prompt:   # past the user's (and system's) text, which may quote the answer
            at = max(at, full.find(m["content"].strip(), at) + len(m["content"].strip()))
        content = message["content"].strip()
        start = full.find(content, at)
        closing = alone[alone.rfind(content) + len(content):]
        if not content or start < 0 or content not in alone or \
                not full.startswith(closing, start + len(content)):
            raise ConfigError(
                f"The chat template {self.source} renders assistant turn {i} of a conversation "
                f"neither as an extension of the turns before it nor as its content followed by "
                f"the closing it writes when that turn is the last, so the assistant's tokens "
                f"cannot be found. Use another template (data.chat.template), or unset it for the "
                f"built-in one.")
        return start, start + len(content) + len(closing)

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
    if config.is_file() and _config_template(_read_config(config)) is not None:
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


def _config_template(config: dict) -> Optional[str]:
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
    text = _config_template(config)
    if text is None:
        raise ConfigError(f"The chat template file {path} has no chat_template (a string, or a "
                          f"list with one named \"default\"). Point data.chat.template at a "
                          f"tokenizer_config.json that has one, or a .jinja file, or unset it "
                          f"for the built-in template.")
    return text, _special_tokens(config)


def _check_syntax(text: str, source: str) -> None:
    """Refuse a template that is not valid Jinja before any data is read."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"The chat template {source} is not valid Jinja: {err} (line "
                          f"{err.lineno} of the template). Fix it, or unset data.chat.template "
                          f"for the built-in one.") from None
