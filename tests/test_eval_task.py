"""The shipped lm-eval task lingua_continuation: it loads offline, its docs are what
setup/make_eval_task.py makes from the embedded corpus, and lm-eval scores it exactly as a
scripted LM predicts (zero- and few-shot)."""

import json
import platform
import socket

import pytest

from lingua.eval.tasks import SHIPPED_TASKS, TASKS_DIR

from .conftest import load_setup_script

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

TASK = "lingua_continuation"
DATA = TASKS_DIR / TASK / "data.jsonl"
DOCS = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
TEST = [d for d in DOCS if d["split"] == "test"]
FEWSHOT = [d for d in DOCS if d["split"] == "train"]


def truth(doc) -> str:
    return doc["choices"][doc["label"]]


@pytest.fixture
def offline(monkeypatch):
    """No network: the offline switches set, and any socket connection recorded and refused."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets reads the variables once, at import, which may have come before this test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    attempts = []

    def refuse(sock, address):
        attempts.append(address)
        raise OSError(f"test_eval_task: no network (tried {address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield attempts
    assert attempts == [], f"loading or evaluating the task tried the network: {attempts}"


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's ~15k built-in tasks takes seconds
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def maker():
    return load_setup_script("make_eval_task")


@pytest.fixture(scope="module")
def corpus_texts(maker):
    """(val, train) docstrings of the embedded corpus, if this Python made data.jsonl."""
    yaml_text = (TASKS_DIR / TASK / f"{TASK}.yaml").read_text(encoding="utf-8")
    made_with = maker.PYTHON_LINE.search(yaml_text).group(2)
    if made_with != platform.python_version():
        pytest.skip(f"data.jsonl was made from Python {made_with}'s docstrings; this is Python "
                    f"{platform.python_version()}")
    return maker.corpus_texts()


def test_task_loads_offline(offline, task_manager):
    assert set(SHIPPED_TASKS) <= set(task_manager.all_tasks)
    task = task_manager.load([TASK])["tasks"][TASK]
    test, fewshot = list(task.test_docs()), list(task.fewshot_docs())
    assert (len(test), len(fewshot)) == (200, 5)
    assert (test, fewshot) == (TEST, FEWSHOT)
    assert task.OUTPUT_TYPE == "multiple_choice" and task.config.target_delimiter == " "
    assert task.aggregation().keys() == task.higher_is_better().keys() == {"acc", "acc_norm"}
    assert all(task.higher_is_better().values())
    for doc in test + fewshot:
        assert task.doc_to_text(doc) == doc["context"]
        assert task.doc_to_choice(doc) == doc["choices"]
        assert task.doc_to_target(doc) == doc["label"]
        assert len(doc["choices"]) == len(set(doc["choices"])) == 4
        assert doc["label"] in range(4)
        # word boundaries: the " " delimiter between them gives back the text as it was
        assert 150 <= len(doc["context"]) <= 250 and not doc["context"][-1].isspace()
        for choice in doc["choices"]:
            assert 40 <= len(choice) <= 80 and not choice[0].isspace() and not choice[-1].isspace()
    assert len({d["id"] for d in DOCS}) == len(DOCS)


@pytest.mark.slow
def test_true_continuation_follows_the_context(corpus_texts):
    val, train = corpus_texts
    for docs, texts in ((TEST, val), (FEWSHOT, train)):
        for doc in docs:
            passages = [doc["context"] + " " + choice for choice in doc["choices"]]
            found = [any(p in text for text in texts) for p in passages]
            assert found == [i == doc["label"] for i in range(4)], doc["id"]
    # held out: no true continuation is text the debug model trains on
    train_text = "\0".join(train)
    assert [doc["id"] for doc in TEST if truth(doc) in train_text] == []


def test_make_eval_task_check(maker, corpus_texts, monkeypatch, tmp_path):
    monkeypatch.setattr(maker, "corpus_texts", lambda: corpus_texts)  # parsed once, above
    assert maker.main(["--check"]) == 0
    tampered = tmp_path / "data.jsonl"
    tampered.write_text(DATA.read_text(encoding="utf-8").replace('"label": 0', '"label": 1', 1),
                        encoding="utf-8")
    assert maker.main(["--check", "--out", str(tampered)]) == 1


class ScriptedLM(LM):
    """Scores each (context, " " + choice) request by score(context, choice, doc)."""

    def __init__(self, score):
        super().__init__()
        self.score, self.contexts = score, []

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            context, continuation = req.args
            assert continuation[0] == " " and continuation[1:] in req.doc["choices"]
            self.contexts.append((req.doc["id"], context))
            out.append((float(self.score(context, continuation[1:], req.doc)), False))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def oracle(context, choice, doc):
    """Knows the true continuation of every test context, from the request text alone."""
    owners = [d for d in TEST if context.endswith(d["context"])]
    assert len(owners) == 1, "the request's context does not end with exactly one test context"
    return 0.0 if choice == truth(owners[0]) else -100.0


def evaluate(task_manager, score, num_fewshot=0):
    lm = ScriptedLM(score)
    out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager,
                                  num_fewshot=num_fewshot, log_samples=False)
    return out, lm


def fraction(predicted) -> float:
    return sum(predicted(d) == d["label"] for d in TEST) / len(TEST)


def first_max(values) -> int:  # np.argmax's tie-breaking
    return max(range(len(values)), key=lambda i: (values[i], -i))


def test_simple_evaluate_exact_accuracy(offline, task_manager):
    out, lm = evaluate(task_manager, oracle)
    res = out["results"][TASK]
    assert (res["acc,none"], res["acc_norm,none"]) == (1.0, 1.0)
    assert res["acc_stderr,none"] == 0.0
    assert sorted(lm.contexts) == sorted((d["id"], d["context"]) for d in TEST for _ in range(4))
    assert out["configs"][TASK]["metadata"]["python"]  # provenance travels with the results

    out, _ = evaluate(task_manager, lambda ctx, choice, doc: -doc["choices"].index(choice))
    res = out["results"][TASK]
    first = fraction(lambda d: 0)
    assert 0 < first < 1
    assert (res["acc,none"], res["acc_norm,none"]) == (first, first)

    # ll = len(choice): acc picks the longest choice; acc_norm divides by len(choice), a tie
    # at 1.0 that np.argmax breaks to the first choice
    out, _ = evaluate(task_manager, lambda ctx, choice, doc: len(choice))
    res = out["results"][TASK]
    longest = fraction(lambda d: first_max([len(c) for c in d["choices"]]))
    assert longest != first
    assert (res["acc,none"], res["acc_norm,none"]) == (longest, first)


def test_simple_evaluate_fewshot(offline, task_manager):
    out, lm = evaluate(task_manager, oracle, num_fewshot=2)
    assert out["results"][TASK]["acc,none"] == 1.0
    assert out["n-shot"][TASK] == 2
    solved = [d["context"] + " " + truth(d) for d in FEWSHOT]
    by_id = {d["id"]: d for d in TEST}
    assert len(lm.contexts) == 4 * len(TEST)
    for doc_id, context in lm.contexts:
        assert sum(s + "\n\n" in context for s in solved) == 2
        assert context.endswith("\n\n" + by_id[doc_id]["context"])


@pytest.mark.slow   # the unknown name reads lm-eval's whole index (10 s)
def test_our_own_tasks_load_without_indexing_lm_evals(offline, monkeypatch):
    """lingua.eval.downstream checks and loads tasks it ships (and eval.include_path's) from an
    index of those alone; lm-eval's own ~15k task YAMLs are read only for a name not there."""
    import lm_eval.tasks

    from lingua.eval import downstream

    built = []
    real = lm_eval.tasks.TaskManager

    def recording(*args, **kwargs):
        built.append(kwargs.get("include_defaults", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", recording)
    downstream.task_manager.cache_clear()
    try:
        downstream.check_task_names([TASK])
        assert set(downstream.load_tasks([TASK])) == {TASK}
        assert built == [False]                  # one index, of ours alone
        with pytest.raises(downstream.ConfigError, match="lingua_continuatoin: did you mean"):
            downstream.check_task_names(["lingua_continuatoin"])   # unknown: the whole index
        assert built == [False, True]
    finally:
        downstream.task_manager.cache_clear()
