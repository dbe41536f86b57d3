"""Chat with a fine-tuning run: `python -m apps.sft.generate RUN_DIR_OR_CHECKPOINT --message TEXT
[--system TEXT] [--messages-file conv.json] [--max-new-tokens 128] [--device cpu]`.

The conversation (the file's messages, then --message as the user's turn; --system first) is
rendered with the chat template the run trained with (its config.yaml's data section:
lingua/data/chat.py), with the generation prompt, and the model (adapters active) answers
greedily until it closes its turn (the token the template ends an assistant turn with: EOS for
the built-in template) or max-new-tokens. Prints the reply.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List

import torch

from apps.sft.hf import chat_template, data_args, load_run, turn_end_id  # noqa: F401 (tests)
from lingua.data.jsonl import BadLine
from lingua.errors import ConfigError
from lingua.eval import generation

PROG = "python -m apps.sft.generate"


def check_messages(messages) -> List[dict]:
    from lingua.data.chat import ROLES

    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise ConfigError(f"the conversation must be a non-empty list of messages "
                          f'{{"role": one of {list(ROLES)}, "content": "text"}} (or an object '
                          f'with such a list under "messages"). Fix --messages-file, or pass '
                          f"--message TEXT.")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_messages(path, system=None, message=None) -> List[dict]:
    """The file's conversation (if any), --system before it, --message after it."""
    messages = []
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--messages-file {path} does not exist.")
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ConfigError(f"--messages-file {path} is not valid JSON ({err}).") from None
        messages = check_messages(obj.get("messages") if isinstance(obj, dict) else obj)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    if message is not None:
        messages.append({"role": "user", "content": message})
    if not messages:
        raise ConfigError("no conversation given: pass --message TEXT (and --system TEXT), or "
                          "--messages-file conv.json.")
    return check_messages(messages)


def reply(model, tokenizer, template, messages, max_new_tokens: int):
    """(prompt ids, new ids) of a greedy answer; the new ids end with the turn's closing token
    when the model wrote it within max_new_tokens."""
    prompt, _ = template.encode(messages, tokenizer, add_generation_prompt=True)
    new = generation.generate(model, prompt, max_new_tokens,
                              eos_id=turn_end_id(template, tokenizer))
    return prompt, new


def load(target, device="cpu"):
    """(model with adapters, tokenizer, template) of a run directory or checkpoint."""
    from lingua.data.tokenizer import build_tokenizer

    model, _, _, run_config, _ = load_run(target, device)
    args = data_args(run_config)   # a run on plain text (not data.format=chat): built-in template
    return model, build_tokenizer(args.tokenizer), chat_template(run_config)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("checkpoint_dir", help="a run directory (its newest complete checkpoint) or "
                                          "<dump_dir>/checkpoints/<step>")
    p.add_argument("--message", help="the user's turn (last)")
    p.add_argument("--system", help="a system message (first)")
    p.add_argument("--messages-file", help='a JSON conversation: [{"role": ..., "content": ...}, '
                                           '...] or {"messages": [...]}')
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = p.parse_args(argv)
    try:
        messages = read_messages(ns.messages_file, ns.system, ns.message)
        model, tokenizer, template = load(ns.checkpoint_dir, ns.device)
        _, new = reply(model, tokenizer, template, messages, ns.max_new_tokens)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BadLine as e:   # the run's Jinja template refused this conversation
        print(f"error: {e}. Give a conversation that template accepts (roles in the order it "
              f"expects).", file=sys.stderr)
        sys.exit(2)
    if new and new[-1] == turn_end_id(template, tokenizer):
        new = new[:-1]
    print(tokenizer.decode(new), flush=True)


if __name__ == "__main__":
    main()
