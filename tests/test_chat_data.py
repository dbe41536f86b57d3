"""The chat format for supervised fine-tuning (lingua/data/chat.py): templates and their
target masks, packing and padding, bad lines, the checks before any work, and rows that are the
same on every data-parallel layout and after a resume.

Expected ids are spelled out here from the byte tokenizer (byte b -> id b, BOS 256, EOS 257),
not taken from the code under test.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lingua.data import (
    DataArgs,
    build_train_loader,
    build_val_batches,
    chat_template,
    loader_class,
    validate_data_args,
)
from lingua.data import chat as chat_data
from lingua.data.chat import (
    ChatArgs,
    ChatLoader,
    ChatTemplate,
    parse_sample,
    write_debug_chat,
)
from lingua.data.jsonl import BadLine
from lingua.data.tokenizer import ByteTokenizer, TokenizerArgs, build_tokenizer
from lingua.errors import ConfigError
from lingua.model.loss import IGNORE_INDEX

BOS, EOS = 256, 257
TOK = ByteTokenizer()

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def b(text: str) -> list:
    return list(text.encode("utf-8"))


def conversation(i: int) -> dict:
    """Conversation i of the test corpora: lengths vary with i; every third has a system
    message, every fourth is in the prompt/completion form."""
    question, answer = f"q{i} " + "x" * (i * 7 % 23), f"a{i} " + "y" * (i * 5 % 17)
    if i % 4 == 0:
        return {"prompt": question, "completion": answer}
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if i % 3 == 0:
        messages.insert(0, {"role": "system", "content": "be brief"})
    return {"messages": messages}


def write_lines(path: Path, lines) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def make_corpus(root: Path, n_train: int = 40, n_val: int = 12, files: int = 2) -> Path:
    per = -(-n_train // files)
    for f in range(files):
        write_lines(root / f"part{f}.jsonl",
                    [conversation(i) for i in range(f * per, min((f + 1) * per, n_train))])
    write_lines(root / "val" / "val.jsonl", [conversation(1000 + i) for i in range(n_val)])
    return root


def chat_args(root, **kw) -> DataArgs:
    chat = ChatArgs(**{k: kw.pop(k) for k in ("pack", "too_long", "template") if k in kw})
    return DataArgs(root=str(root), format="chat", **{"seq_len": 64, "batch_size": 2,
                                                      "val_sequences": 4, **kw}, chat=chat)


def builtin_ids(messages) -> tuple:
    """The built-in template spelled out by hand: ids and the counted mask."""
    ids, counted = [BOS], [False]
    for m in messages:
        header = b(f"<|{m['role']}|>\n")
        ids += header
        counted += [False] * len(header)
        if m["role"] == "assistant":
            ids += b(m["content"]) + [EOS]
            counted += [True] * (len(b(m["content"])) + 1)
        else:
            ids += b(m["content"] + "\n")
            counted += [False] * len(b(m["content"] + "\n"))
    return ids, counted


# ------------------------------------------------------------------------------------------------
# lines


def test_parse_sample_reads_both_forms_and_names_what_is_wrong():
    assert parse_sample({"prompt": "hi", "completion": "yo"}) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "extra": 1}]
    assert parse_sample({"messages": msgs}) == [{"role": m["role"], "content": m["content"]}
                                                 for m in msgs]
    bad = {"not_chat": [[1, 2], {"text": "x"}, {"messages": []}, {"prompt": "p"},
                        {"messages": [{"role": "user"}]}],
           "bad_role": [{"messages": [{"role": "tool", "content": "t"},
                                      {"role": "assistant", "content": "a"}]}],
           "no_assistant": [{"messages": [{"role": "user", "content": "u"}]},
                            {"prompt": "p", "completion": ""}],
           "invalid_utf8": [{"prompt": "\ud800", "completion": "a"}]}
    for reason, objs in bad.items():
        for obj in objs:
            with pytest.raises(BadLine) as err:
                parse_sample(obj)
            assert err.value.reason == reason, obj
    with pytest.raises(BadLine, match="role 'tool'"):
        parse_sample(bad["bad_role"][0])
    # issue 58: another format's key is named, not only counted as not_chat
    with pytest.raises(BadLine, match='message 1 has "text" where "content" is expected') as err:
        parse_sample({"messages": [{"role": "user", "content": "u"},
                                   {"role": "assistant", "text": "a"}]})
    assert err.value.reason == "not_chat"


# ------------------------------------------------------------------------------------------------
# templates


def test_builtin_template_counts_the_assistant_content_and_eos_only(tmp_path):
    template = ChatTemplate.from_args(chat_args(tmp_path))
    assert template.source == chat_data.BUILTIN
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "é2"}]
    ids, counted = template.encode(msgs, TOK)
    expected = ([BOS] + b("<|system|>\nS\n<|user|>\nU1\n<|assistant|>\n") + b("A1") + [EOS]
                + b("<|user|>\nU2\n<|assistant|>\n") + b("é2") + [EOS])
    assert ids == expected
    assert [i for i, c in zip(ids, counted) if c] == b("A1") + [EOS] + b("é2") + [EOS]
    assert (ids, counted) == builtin_ids(msgs)
    gen, gen_counted = template.encode(msgs[:2], TOK, add_generation_prompt=True)
    assert gen == [BOS] + b("<|system|>\nS\n<|user|>\nU1\n<|assistant|>\n")
    assert not any(gen_counted)


def write_hf_tokenizer(directory: Path, template: str = LLAMA3_TEMPLATE) -> Path:
    """The byte tokenizer's tokenizer.json plus Llama 3's special tokens (ids 258-261), and a
    tokenizer_config.json with the chat template."""
    from lingua.checkpoint.hf_files import byte_tokenizer_json

    directory.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer_json()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_template_renders_as_transformers_and_counts_each_assistant_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_dir = write_hf_tokenizer(tmp_path / "tok")
    args = chat_args(tmp_path, tokenizer=TokenizerArgs("hf", str(hf_dir / "tokenizer.json")))
    template, tokenizer = ChatTemplate.from_args(args), build_tokenizer(args.tokenizer)
    assert template.source == str(hf_dir / "tokenizer_config.json")
    special = {t: tokenizer.model.token_to_id(t) for t in LLAMA3_SPECIALS}
    assert (tokenizer.bos_id, tokenizer.eos_id) == (special["<|begin_of_text|>"],
                                                    special["<|eot_id|>"])
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"}]
    for convo, gen in ((msgs, False), (msgs[:4], True)):
        text = reference.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen)
        assert template.render(convo, gen) == text
        ids, counted = template.encode(convo, tokenizer, add_generation_prompt=gen)
        assert ids == reference.encode(text, add_special_tokens=False)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids, counted = template.encode(msgs, tokenizer)
    assert ids[0] == tokenizer.bos_id and ids.count(special["<|start_header_id|>"]) == 5
    # the turns' content (trimmed by the template) and their end-of-turn tokens, nothing else
    eot = special["<|eot_id|>"]
    assert [i for i, c in zip(ids, counted) if c] == b("4") + [eot] + b("6") + [eot]


# Qwen3's rule, written small: an assistant turn after the last user message gets an empty
# <think> block, earlier ones lose it, so a render of messages[:i+1] is no prefix of the whole.
THINK_DROPPING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{ m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_rewrites_earlier_turns_counts_each_turns_content_and_closing(tmp_path):
    """Qwen3's own template (multi-turn conversations): each assistant turn counts its content and
    its <|im_end|>, the last one also its empty think block, and nothing of the user's (who here
    quotes the first answer)."""
    jinja = tmp_path / "qwen3_like.jinja"
    jinja.write_text(THINK_DROPPING)
    template = ChatTemplate.from_args(chat_args(tmp_path, template=str(jinja)))
    msgs = [{"role": "user", "content": "say ok"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and again?"}, {"role": "assistant", "content": "ok!"}]
    ids, counted = template.encode(msgs, TOK)
    assert ids == b(template.render(msgs)) and b"</think>" in bytes(ids)
    assert bytes(i for i, c in zip(ids, counted) if c) == (
        b"ok<|im_end|>\n<think>\n\n</think>\n\nok!<|im_end|>\n")


def test_template_files_are_found_and_a_jinja_file_works_with_the_byte_tokenizer(tmp_path):
    hf_dir = write_hf_tokenizer(tmp_path / "tok")
    hf = TokenizerArgs("hf", str(hf_dir / "tokenizer.json"))
    assert ChatTemplate.from_args(chat_args(tmp_path, tokenizer=hf)).source.endswith(
        "tokenizer_config.json")
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_args(chat_args(tmp_path, tokenizer=hf)).source == chat_data.BUILTIN
    # A .jinja template with the byte tokenizer: bos_token/eos_token are <s>/</s>, its BOS/EOS.
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                     "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}[assistant]{% endif %}")
    template = ChatTemplate.from_args(chat_args(tmp_path, template=str(jinja)))
    assert (template.special["bos_token"], template.special["eos_token"]) == ("<s>", "</s>")
    ids, counted = template.encode([{"role": "user", "content": "u"},
                                    {"role": "assistant", "content": "a"}], TOK)
    assert ids == [BOS] + b("[user]u[assistant]a") + [EOS]
    assert [i for i, c in zip(ids, counted) if c] == b("a") + [EOS]


def test_special_tokens_are_read_as_text_or_added_token_form():
    config = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "lstrip": False},
              "model_max_length": 4, "pad_token": None}
    assert chat_template._special_tokens(config) == {"bos_token": "<s>", "eos_token": "<|im_end|>"}


def test_a_template_whose_turns_cannot_be_found_is_refused(tmp_path):
    jinja = tmp_path / "reverse.jinja"   # renders the messages last first: no prefix chain
    jinja.write_text("{% for m in messages|reverse %}{{ m['content'] }}|{% endfor %}")
    template = ChatTemplate.from_args(chat_args(tmp_path, template=str(jinja)))
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ConfigError, match=f"chat template {jinja} renders assistant turn 1 of"):
        template.encode(msgs, TOK)


# ------------------------------------------------------------------------------------------------
# rows


def all_rows(loader, steps):
    batches = [mb for _ in range(steps) for mb in loader.next_step()]
    return (torch.cat([x.tokens for x in batches]), torch.cat([x.labels for x in batches]),
            torch.cat([x.doc_ids for x in batches]))


def test_packed_rows_keep_conversations_whole_and_train_on_answers_only(tmp_path):
    root = make_corpus(tmp_path / "c", n_train=30)
    args = chat_args(root, seq_len=96, batch_size=1)
    loader = ChatLoader(args, 0, 1, seed=3)
    epoch_rows = len(loader._rows_of_epoch(0))
    tokens, labels, docs = all_rows(loader, epoch_rows)
    # Each conversation once, whole, in its own document id; rows recover them exactly.
    expected = sorted(tuple(builtin_ids(parse_sample(conversation(i)))[0]) for i in range(30))
    found, targets = [], []
    for row, lab, doc in zip(tokens.tolist(), labels.tolist(), docs.tolist()):
        full = row + [None]
        for d in sorted(set(doc)):
            at = [t for t in range(len(doc)) if doc[t] == d]
            assert at == list(range(at[0], at[-1] + 1))   # contiguous
            ids = [full[t] for t in at] + ([lab[at[-1]]] if lab[at[-1]] != IGNORE_INDEX else [])
            if ids[0] == BOS:
                found.append(tuple(ids if ids[-1] == EOS else ids + [EOS]))
            else:
                assert set(ids) == {EOS} and all(x == IGNORE_INDEX for x in
                                                 [lab[t] for t in at])   # padding
        for t in range(len(doc) - 1):
            if doc[t] != doc[t + 1]:
                assert lab[t] == IGNORE_INDEX   # no target across a conversation boundary
        targets += [x for x in lab if x != IGNORE_INDEX]
    assert sorted(found) == expected
    answers = [x for i in range(30) for x, c in zip(*builtin_ids(parse_sample(conversation(i))))
               if c]
    assert sorted(targets) == sorted(answers)
    assert epoch_rows < 30   # packed: several a row


def test_padded_rows_hold_one_conversation_each(tmp_path):
    root = make_corpus(tmp_path / "c", n_train=8)
    loader = ChatLoader(chat_args(root, seq_len=96, batch_size=4, pack=False), 0, 1, seed=0)
    tokens, labels, docs = all_rows(loader, 4)   # two epochs, each in its own order
    order = np.concatenate([np.random.default_rng([0, e]).permutation(8) for e in (0, 1)])
    assert list(order[:8]) != list(order[8:])
    for row, lab, doc, i in zip(tokens.tolist(), labels.tolist(), docs.tolist(), order):
        ids, counted = builtin_ids(parse_sample(conversation(int(i))))
        n = len(ids)
        assert row[:n] == ids and set(row[n:]) <= {EOS}
        assert doc == [0] * n + [1] * (96 - n)
        assert lab == [x if c else IGNORE_INDEX for x, c in zip(ids[1:], counted[1:])] + \
            [IGNORE_INDEX] * (96 - n + 1)


def test_no_target_crosses_into_a_conversation_that_starts_with_the_assistant(tmp_path):
    jinja = tmp_path / "bare.jinja"   # no BOS, no header: the answer's first token comes first
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    write_lines(tmp_path / "c" / "a.jsonl",
                [{"messages": [{"role": "assistant", "content": f"answer {i}"}]} for i in range(6)])
    args = chat_args(tmp_path / "c", seq_len=40, batch_size=1, template=str(jinja))
    loader = ChatLoader(args, 0, 1, seed=0)
    tokens, labels, docs = all_rows(loader, 2)
    assert tokens[0, :9].tolist() == b("answer 3") + [EOS]   # 9 + 9 + 9 + 9 tokens a row
    # 6 conversations of 9 tokens in rows of 41: 4 in the first row, 2 and padding in the next
    for lab, doc, n in zip(labels.tolist(), docs.tolist(), (4, 2)):
        starts = [t for t in range(1, len(doc)) if doc[t] != doc[t - 1]]
        assert starts == [9, 18, 27, 36][:n]
        assert all(lab[t - 1] == IGNORE_INDEX for t in starts)   # 'a' of the next answer
        assert sum(x != IGNORE_INDEX for x in lab) == n * 8   # each answer's 'nswer i' + EOS


def test_too_long_conversations_are_truncated_or_skipped_and_counted(tmp_path):
    long = {"prompt": "p", "completion": "z" * 100}
    prompt_only = {"prompt": "p" * 100, "completion": "z"}   # cut: no answer token left
    write_lines(tmp_path / "c" / "a.jsonl", [conversation(1), long, prompt_only, conversation(2)])
    args = chat_args(tmp_path / "c", seq_len=60, batch_size=1, val_sequences=0)
    cut = ChatLoader(args, 0, 1, seed=0)
    assert (len(cut.convs), cut.truncated_samples) == (3, 1)
    assert cut.skipped()["too_long"] == 1
    assert max(cut.convs.lengths) == 61 and sum(cut.skipped().values()) == 1
    args.chat.too_long = "skip"
    skip = ChatLoader(args, 0, 1, seed=0)
    assert (len(skip.convs), skip.truncated_samples, skip.skipped()["too_long"]) == \
        (2, 0, 2)


def test_malformed_lines_are_counted_by_reason_and_skipped(tmp_path, caplog):
    root = tmp_path / "c"
    write_lines(root / "a.jsonl", [conversation(1), "{not json", "", conversation(2),
                                   {"messages": [{"role": "user", "content": "u"}]},
                                   {"prompt": 1, "completion": "x"}])
    (root / "b.jsonl").write_bytes(b'{"prompt": "\xff", "completion": "x"}\n' +
                                   json.dumps(conversation(3)).encode() + b"\n")
    args = chat_args(root, seq_len=128, val_sequences=0, batch_size=4)
    caplog.set_level("INFO", logger="lingua.data.chat")
    loader = ChatLoader(args, 0, 1, seed=0)
    assert len(loader.convs) == 3 and sum(loader.skipped().values()) == 4
    # the row length in its unit: seq_len inputs and the last one's target
    assert "cut to a row of data.seq_len+1 = 129 tokens: 128 inputs and the last" in caplog.text
    assert {k: n for k, n in loader.skipped().items() if n} == {
        "invalid_json": 1, "no_assistant": 1, "not_chat": 1, "invalid_utf8": 1}
    assert f"skipping unusable line 2 of {root / 'a.jsonl'} (invalid_json" in caplog.text
    # 3 conversations pack into 2 rows, for a global batch of 4: said once
    assert caplog.text.count("2 rows an epoch, fewer than the global batch of 4") == 1
    assert "every step repeats rows" in caplog.text
    caplog.clear()
    ChatLoader(chat_args(make_corpus(tmp_path / "enough")), 0, 1, seed=0)
    assert "fewer than the global batch" not in caplog.text
    # every rank reads every line; the trainer sums over ranks, so rank 1 reports none
    other = ChatLoader(args, 1, 2, seed=0)
    assert sum(other.skipped().values()) == 0 and set(other.skipped().values()) == {0}
    assert set(other.skipped()) == set(loader.skipped())


# ------------------------------------------------------------------------------------------------
# layouts, resume, step_targets


def global_batch(root, steps, dp, batch_size, grad_accum, **kw):
    """Per step: the global batch's tokens and labels (ranks' micro-batches concatenated in
    rank order), and each rank's step_targets."""
    args = chat_args(root, batch_size=batch_size, grad_accum=grad_accum, **kw)
    loaders = [ChatLoader(args, r, dp, seed=5) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [loader.next_step() for loader in loaders]
        mbs = [mb for rank in per_rank for mb in rank]
        assert len({mb.step_targets for mb in mbs}) == 1
        out.append((torch.cat([mb.tokens for mb in mbs]), torch.cat([mb.labels for mb in mbs]),
                    torch.cat([mb.doc_ids for mb in mbs]), mbs[0].step_targets))
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_the_global_batch_is_the_same_on_every_layout(tmp_path, pack):
    root = make_corpus(tmp_path / "c", n_train=25)
    steps = 9   # past the end of the first epoch
    reference = global_batch(root, steps, dp=1, batch_size=4, grad_accum=1, pack=pack)
    for dp, bs, accum in ((2, 2, 1), (2, 1, 2), (4, 1, 1)):
        other = global_batch(root, steps, dp=dp, batch_size=bs, grad_accum=accum, pack=pack)
        for (t, lab, d, n), (t2, lab2, d2, n2) in zip(reference, other):
            assert torch.equal(t, t2) and torch.equal(lab, lab2) and torch.equal(d, d2)
            assert n == n2 == int((lab != IGNORE_INDEX).sum())   # step_targets counts them
    assert len({int(t.sum()) for t, *_ in reference}) > 1   # steps differ


def test_a_restored_loader_continues_exactly_on_any_layout(tmp_path):
    root = make_corpus(tmp_path / "c", n_train=25)
    args = chat_args(root, batch_size=4)
    straight = ChatLoader(args, 0, 1, seed=7)
    for _ in range(4):
        straight.next_step()
    state = json.loads(json.dumps(straight.state_dict()))   # as a checkpoint keeps it
    expected = [straight.next_step()[0] for _ in range(5)]
    half = dataclasses.replace(args, batch_size=2)
    resumed = [ChatLoader(half, r, 2, seed=7) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    for want in expected:
        got = [loader.next_step()[0] for loader in resumed]
        assert torch.equal(want.tokens, torch.cat([g.tokens for g in got]))
        assert torch.equal(want.labels, torch.cat([g.labels for g in got]))
        assert want.step_targets == got[0].step_targets == got[1].step_targets
    other_seed = ChatLoader(args, 0, 1, seed=8)
    with pytest.raises(ConfigError, match="seed=7.*seed=8"):
        other_seed.load_state_dict(state)
    unpacked = ChatLoader(chat_args(root, batch_size=4, pack=False), 0, 1, seed=7)
    with pytest.raises(ConfigError, match="pack=True.*pack=False"):
        unpacked.load_state_dict(state)


def test_validation_rows_are_in_file_order_and_split_across_ranks(tmp_path):
    root = make_corpus(tmp_path / "c", n_val=30)
    args = chat_args(root, seq_len=64, batch_size=2, val_sequences=7)
    one = ChatLoader.val_batches(args, 0, 1)
    assert sum(len(x.tokens) for x in one) == 7
    first = builtin_ids(parse_sample(conversation(1000)))[0]
    assert one[0].tokens[0, :len(first)].tolist() == first   # no shuffle
    two = [ChatLoader.val_batches(args, r, 2) for r in range(2)]   # 7 -> 6 rows, 3 a rank
    rows = torch.cat([x.tokens for rank in two for x in rank])
    assert torch.equal(rows, torch.cat([x.tokens for x in one])[:6])
    assert [len(x.tokens) for x in two[1]] == [2, 1]
    assert build_val_batches(args, 0, 1)[0].labels.tolist() == one[0].labels.tolist()


# ------------------------------------------------------------------------------------------------
# data.py dispatch and the checks before any work


def test_data_py_dispatches_the_chat_format(tmp_path):
    root = make_corpus(tmp_path / "c")
    args = chat_args(root)
    validate_data_args(args)
    loader_class(args).check_ranks(args, dp_size=64)   # no per-rank share: every rank reads all
    assert isinstance(build_train_loader(args, 0, 1, seed=0), ChatLoader)
    assert DataArgs().chat == ChatArgs()


def refused(args) -> str:
    with pytest.raises(ConfigError) as err:
        validate_data_args(args)
    return str(err.value)


def test_a_line_that_is_no_conversation_is_skipped_and_counted_too_many_refused(tmp_path):
    """The one rule for unusable lines (as for invalid JSON, and in the jsonl format): skipped
    and counted by reason; more than data.max_skipped_fraction of them refused before any work,
    naming the first."""
    root = make_corpus(tmp_path / "c")
    args = chat_args(root)
    cases = [({"messages": [{"role": "user", "content": "u"}]}, "no_assistant"),
             ({"prompt": "p", "completion": ""}, "no_assistant"),
             ({"messages": [{"role": "bot", "content": "u"}]}, "bad_role"),
             ({"text": "plain"}, "not_chat")]
    for bad, reason in cases:
        write_lines(root / "part1.jsonl", [conversation(1), conversation(2), bad])
        validate_data_args(args)
        loader = ChatLoader(args, 0, 1, seed=0)
        assert loader.skipped()[reason] == 1
    # 20 conversations in part0, 100 in part1, then lines of no conversation: the 14th makes
    # more than a tenth of the lines read
    write_lines(root / "part1.jsonl", [conversation(i) for i in range(100)]
                + [{"messages": [{"role": "user", "content": "u"}]}] * 16)
    message = refused(args)
    assert ("14 of the first 134 lines of " in message
            and f"the first is line 101 of {root / 'part1.jsonl'} (no_assistant: no assistant "
                f"turn" in message and "data.max_skipped_fraction=0.1" in message), message
    validate_data_args(chat_args(root, max_skipped_fraction=0.2))
    write_lines(root / "part1.jsonl", [conversation(1)])
    write_lines(root / "val" / "val.jsonl",
                [{"messages": [{"role": "user", "content": "u"}]}] * 120)
    assert f"line 1 of {root / 'val' / 'val.jsonl'}" in refused(args)


def test_lines_that_are_not_json_are_only_counted_but_all_bad_is_refused(tmp_path):
    root = make_corpus(tmp_path / "c")
    write_lines(root / "part1.jsonl", ["{oops", conversation(1)])
    validate_data_args(chat_args(root))
    for f in root.glob("*.jsonl"):
        write_lines(f, ["{oops", "[1,"])
    assert "has no usable conversation" in refused(chat_args(root))


def test_missing_files_a_bad_option_and_a_silent_template_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no *.jsonl file of conversations" in refused(chat_args(empty))
    root = make_corpus(tmp_path / "c")
    (root / "val" / "val.jsonl").unlink()
    assert f"{root / 'val'} holds no *.jsonl" in refused(chat_args(root))
    validate_data_args(chat_args(root, val_sequences=0))
    assert "data.chat.too_long='cut' is unknown" in refused(
        chat_args(root, val_sequences=0, too_long="cut"))
    silent = tmp_path / "silent.jinja"   # writes the user's turns only
    silent.write_text("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                      "{% endif %}{% endfor %}")
    message = refused(chat_args(root, val_sequences=0, template=str(silent)))
    assert f"The chat template {silent} renders no assistant tokens" in message
    assert "Line 1 of" not in message and "line 1 of" in message
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    assert f"The chat template {broken} is not valid Jinja" in refused(
        chat_args(root, val_sequences=0, template=str(broken)))
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('roles must alternate') }}")
    assert "roles must alternate" in refused(
        chat_args(root, val_sequences=0, template=str(raising)))
    assert "does not exist" in refused(
        chat_args(root, val_sequences=0, template=str(tmp_path / "nope.json")))


def test_write_debug_chat_writes_a_usable_corpus(tmp_path, monkeypatch):
    docs = [f"Doc {i}: " + " ".join(f"word{j}" for j in range(60)) for i in range(7)]
    monkeypatch.setattr(chat_data, "stdlib_docstrings", lambda: docs)
    root = write_debug_chat(tmp_path / "chat", n_train=20, n_val=5)
    train = [json.loads(x) for x in (root / "train.jsonl").read_text().splitlines()]
    val = (root / "val" / "val.jsonl").read_text().splitlines()
    assert len(train) == 20 and len(val) == 5
    assert {("messages" in x, len(x.get("messages", []))) for x in train} == {
        (False, 0), (True, 2), (True, 3)}
    assert not list(tmp_path.glob(".chat.tmp-*"))
    args = chat_args(root, seq_len=256)
    validate_data_args(args)
    assert len(ChatLoader(args, 0, 1, seed=0).convs) == 20
    assert write_debug_chat(root) == root   # already there: left as it is


def test_tokenized_conversations_are_cached_and_read_back_alike(tmp_path, caplog, monkeypatch):
    """The second start reads data.root/.chat_cache: the same rows, counts and first-line
    warning as tokenizing; a changed file makes a new cache; a read-only root tokenizes."""
    root = make_corpus(tmp_path / "c")
    with open(root / "part0.jsonl", "a") as f:
        f.write("{not json\n")
    args = chat_args(root)
    calls, tokenize = [], chat_data.tokenize_conversations
    monkeypatch.setattr(chat_data, "tokenize_conversations",
                        lambda *a, **k: calls.append(1) or tokenize(*a, **k))
    caches = lambda: len(list((root / chat_data.CACHE_DIR).iterdir()))   # noqa: E731
    warned = lambda: [r.getMessage() for r in caplog.records   # noqa: E731
                      if r.getMessage().startswith("skipping unusable line")]
    first = ChatLoader(args, 0, 1, seed=0)
    assert len(calls) == 1 and caches() == 1
    [warning] = warned()
    caplog.clear()
    again = ChatLoader(args, 0, 1, seed=0)
    assert len(calls) == 1   # read, not tokenized
    assert warned() == [warning]
    assert again.skipped() == first.skipped()
    assert again.skipped()["invalid_json"] == 1 and again.skipped()["too_long"]
    assert again.truncated_samples == first.truncated_samples
    for _ in range(3):
        a, b = first.next_step()[0], again.next_step()[0]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.doc_ids, b.doc_ids)
    validate_data_args(args)
    write_lines(root / "part1.jsonl", [conversation(i) for i in range(5)])
    ChatLoader(args, 0, 1, seed=0)
    assert len(calls) == 2 and caches() == 2   # another file: another cache

    def read_only(*_):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(chat_data, "write_once", read_only)
    write_lines(root / "part1.jsonl", [conversation(i) for i in range(6)])
    caplog.clear()
    assert len(ChatLoader(args, 0, 1, seed=0).convs) > 0
    assert "could not cache the tokenized conversations" in caplog.text and caches() == 2


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-9])


def _out_of_vocabulary(path: Path) -> None:   # the same size, ids no embedding has
    ids = np.load(path)
    np.save(path, np.full_like(ids, 70000))


def _flip_within_vocabulary(path: Path) -> None:   # one id's low byte: still a byte's id
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_truncate, _out_of_vocabulary, _flip_within_vocabulary])
def test_a_damaged_chat_cache_is_rebuilt_with_a_warning(tmp_path, caplog, monkeypatch, damage):
    """Issue 58: a truncated, overwritten or bit-flipped .chat_cache fails its checksum, is named
    in a warning and rebuilt; the rows are those of a fresh tokenization, and the next start
    reads the rebuilt cache."""
    root = make_corpus(tmp_path / "c")
    args = chat_args(root)
    fresh = ChatLoader(args, 0, 1, seed=0)
    [cache] = (root / chat_data.CACHE_DIR).iterdir()
    ids = cache / "ids.npy"
    before = ids.read_bytes()
    damage(ids)
    assert ids.read_bytes() != before
    calls, tokenize = [], chat_data.tokenize_conversations
    monkeypatch.setattr(chat_data, "tokenize_conversations",
                        lambda *a, **k: calls.append(1) or tokenize(*a, **k))
    rebuilt = ChatLoader(args, 0, 1, seed=0)
    assert len(calls) == 1 and f"the tokenized cache file {ids} is damaged" in caplog.text
    assert ids.read_bytes() == before and [p.name for p in cache.parent.iterdir()] == [cache.name]
    caplog.clear()
    again = ChatLoader(args, 0, 1, seed=0)
    assert len(calls) == 1 and "tokenized cache file" not in caplog.text   # read back
    for _ in range(3):
        want = fresh.next_step()[0]
        for loader in (rebuilt, again):
            got = loader.next_step()[0]
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)


@pytest.mark.distributed
def test_a_damaged_chat_cache_is_rebuilt_once_on_two_ranks(tmp_path):
    """Rank 0 checks and rebuilds it while rank 1 waits, then rank 1 reads the rebuilt cache
    (no tokenizing, no warning of its own); each rank's rows are those of a fresh cache."""
    from tests.conftest import run_torchrun

    root = make_corpus(tmp_path / "c")
    args = chat_args(root, val_sequences=0)
    want = [ChatLoader(args, rank, 2, seed=0).next_step()[0].tokens.tolist() for rank in (0, 1)]
    [cache] = (root / chat_data.CACHE_DIR).iterdir()
    before = (cache / "ids.npy").read_bytes()
    _flip_within_vocabulary(cache / "ids.npy")
    out = tmp_path / "out"
    out.mkdir()
    proc = run_torchrun(2, "tests.workers.chat_cache_worker", [str(root), str(out)], timeout=120)
    got = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [g["tokenized"] for g in got] == [1, 0] and [g["tokens"] for g in got] == want
    assert proc.stdout.count("tokenized cache file") == 1 and "[rank0]" in proc.stdout
    assert (cache / "ids.npy").read_bytes() == before
