"""Config composition and refusal of bad input before any work starts."""


import pytest
from omegaconf import OmegaConf

from apps.llama.train import TrainArgs, validate
from lingua import config
from lingua.errors import ConfigError
from tests.conftest import REPO, run_python, tiny_args


def load(argv):
    return config.load("llama", TrainArgs, argv, validate)


def test_debug_preset_and_overrides(corpus, tmp_path):
    args = load(tiny_args(corpus, tmp_path / "run", "optim.lr=0.01", "model.dim=128"))
    assert isinstance(args, TrainArgs)
    assert args.optim.lr == 0.01 and args.model.dim == 128
    assert args.data.root == str(corpus)
    default = config.load("llama", TrainArgs, [])
    assert default.model.n_layers == 4 and default.data.prepare_embedded is True


def test_gpu_presets_compose_with_their_usual_shapes(tmp_path):
    tok = tmp_path / "tok.model"
    tok.write_text("x")
    shapes = {"llama_1b": (2048, 16, 32, 8), "llama_8b": (4096, 32, 32, 8),
              "llama_70b": (8192, 80, 64, 8)}
    for preset, (dim, layers, heads, kv) in shapes.items():
        cfg = config.compose_config("llama", [f"config={preset}", f"data.root={tmp_path}",
                                              f"data.tokenizer.path={tok}"])
        m = cfg.model
        assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads) == (dim, layers, heads, kv)
        assert cfg.distributed.model_dtype == "bf16"


def test_gpu_preset_without_its_data_names_the_keys_to_set(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.root is not set"):
        load(["config=llama_1b"])
    with pytest.raises(ConfigError, match=r"data\.tokenizer\.path"):
        load(["config=llama_1b", f"data.root={tmp_path}"])


@pytest.mark.parametrize("override,needle", [
    ("model.dimm=3", "dimm"),                    # unknown key
    ("optim.lr=fast", "optim.lr"),               # wrong type
    ("steps=-3", "steps"),                       # impossible value
    ("model.n_kv_heads=3", "n_kv_heads"),        # 8 heads not divisible by 3 kv heads
    ("optim.scheduler=step", "optim.scheduler"),
    ("data.seq_len=4096", "max_seq_len"),
    ("model.vocab_size=100", "vocab_size"),
    ("distributed.model_dtype=fp8", "model_dtype"),
    ("config=nope", "nope"),
    ("distributed.cpu_offload=true", "cpu_offload"),   # no GPU here: nothing to offload from
    ("distributed.ac=sometimes", "distributed.ac"),
    ("gc_every=-1", "gc_every=-1"),
    ("gc_full_every=-5", "gc_full_every"),
])
def test_bad_config_is_refused_with_the_key_named(corpus, tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        load(tiny_args(corpus, tmp_path / "run", override))


def test_map_entries_are_set_without_a_plus(tmp_path):
    """data.sources is a Dict field: its entries are not schema keys, yet a plain override sets
    them (Hydra's struct mode would ask for `+`); Hydra's `+` form still works; values keep their
    type; the map is found from the schema, so a fork's own Dict fields get the same."""
    for name in ("books", "web"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.jsonl").write_text('{"text": "a document"}\n')
    base = ["data.format=jsonl", f"data.root={tmp_path}", "data.val_sequences=0"]
    assert config.schema_keys(TrainArgs)["data.sources"] is True
    assert config.schema_keys(TrainArgs)["data.root"] is False
    assert load([*base, "data.sources.books=2"]).data.sources == {"books": 2.0}
    assert load([*base, "data.sources={books:1,web:3}"]).data.sources == {"books": 1.0, "web": 3.0}
    assert load([*base, "+data.sources.web=0.5"]).data.sources == {"web": 0.5}
    assert load([*base, "data.sources.web=1", "data.sources.web=4"]).data.sources == {"web": 4.0}
    with pytest.raises(ConfigError) as err:
        load([*base, "data.sources.books=many"])
    message = str(err.value)
    assert "data.sources.books" in message and "takes a float, not 'many'" in message
    assert "++" not in message and "Did you mean" not in message
    with pytest.raises(ConfigError, match="holds no"):  # the app's own check still runs
        load([*base, "data.sources.papers=1"])


@pytest.mark.parametrize("override,suggestion", [
    ("optim.warmpu=3", "Did you mean optim.warmup?"),
    ("stesp=3", "Did you mean steps?"),
    ("distributed.dp_shrad=2", "Did you mean distributed.dp_shard?"),
    ("data.srcs=1", "Did you mean data.sources?"),
])
def test_misspelt_key_gets_the_closest_real_key(corpus, tmp_path, override, suggestion):
    with pytest.raises(ConfigError) as err:
        load(tiny_args(corpus, tmp_path / "run", override))
    assert suggestion in str(err.value)
    # Hydra's `+` hint does not apply: the schema is closed
    assert "To append to your config" not in str(err.value)


def test_unrelated_bad_key_gets_no_suggestion(corpus, tmp_path):
    with pytest.raises(ConfigError) as err:
        load(tiny_args(corpus, tmp_path / "run", "zzzz.qqq=1"))
    assert "Did you mean" not in str(err.value) and "zzzz.qqq" in str(err.value)


def test_bad_input_files_are_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="missing_dir"):
        load(tiny_args(corpus, tmp_path / "run", f"data.root={tmp_path / 'missing_dir'}"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty"):
        load(tiny_args(corpus, tmp_path / "run", f"data.root={empty}"))
    with pytest.raises(ConfigError, match="no_such.model"):
        load(tiny_args(corpus, tmp_path / "run", "data.tokenizer.kind=sentencepiece",
                       f"data.tokenizer.path={tmp_path / 'no_such.model'}"))


def test_world_size_mismatch_is_refused(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"dp_replicate=2 x dp_shard=2 x cp=1 x tp=1 x pp=1 = 4, "
                                          r"but 3 processes"):
        load(tiny_args(corpus, tmp_path / "run", "distributed.dp_replicate=2",
                       "distributed.dp_shard=2"))


def test_config_dump_round_trips(corpus, tmp_path):
    args = load(tiny_args(corpus, tmp_path / "run"))
    config.dump(args, tmp_path / "config.yaml")
    again = config.from_dict(TrainArgs, OmegaConf.load(tmp_path / "config.yaml"))
    assert again == args


def test_cli_error_is_one_paragraph_without_traceback_and_touches_nothing(corpus, tmp_path):
    dump = tmp_path / "never_created"
    proc = run_python("apps.llama.train", tiny_args(corpus, dump, "model.n_kv_heads=3"),
                      check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "n_kv_heads" in proc.stderr
    assert not dump.exists()
    # Hydra must not have made an outputs/ directory or changed the working directory.
    assert not (REPO / "outputs").exists()


@pytest.mark.parametrize("world,overrides,needle", [
    (3, ["distributed.tp=2", "distributed.dp_shard=1"],
     r"dp_shard=1 x cp=1 x tp=2 x pp=1 = 2, but 3"),
    (3, ["distributed.tp=3", "distributed.dp_shard=1"], r"n_heads=4.*tp=3|tp=3.*n_heads=4"),
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "model.n_kv_heads=1"], r"n_kv_heads=1"),
    (4, ["distributed.cp=2", "distributed.tp=2", "distributed.dp_shard=1", "data.seq_len=36"],
     r"36.*2 x cp x tp|2\*cp\*tp|8"),
    (4, ["distributed.pp=4", "distributed.dp_shard=1"],
     r"4 pipeline stages|more stages|stages.*2 layers|2 layers"),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_microbatches=3"],
     r"pp_microbatches=3|3 micro"),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_schedule=Zigzag"],
     r"Zigzag"),
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "model.tie_embeddings=true"],
     r"tie_embeddings"),
    (1, ["distributed.async_tp=true"], r"async"),
])
def test_impossible_parallel_layouts_are_refused_before_any_work(corpus, tmp_path, monkeypatch,
                                                                world, overrides, needle):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=needle):
        load(tiny_args(corpus, tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()


def test_contract_spellings_that_are_python_keywords():
    """DESIGN's `checkpoint.async=...` and `eval.async=...` (no dataclass field can be named
    `async`) mean checkpoint.async_save and eval.mode."""
    from apps.llama.train import load_config

    args = load_config(["checkpoint.async=true", "eval.async=false"])
    assert args.checkpoint.async_save is True and args.eval.mode == "inline"
    args = load_config(["checkpoint.async=false"], check=False)
    assert args.checkpoint.async_save is False
    assert load_config(["eval.async=true"], check=False).eval.mode == "async"


def test_every_mistake_is_named_in_one_try(corpus, tmp_path):
    """Issue 58: a key typo, a value of the wrong type and an impossible value in one command
    are one ConfigError naming all three (each override refused alone, the rest checked)."""
    from apps.llama.train import load_config

    argv = tiny_args(corpus, tmp_path / "run", "optim.warmpu=3", "steps=ten", "gc_every=-1")
    for entry in (load_config, load):   # the apps' path (validated later) and config.load's
        with pytest.raises(ConfigError) as err:
            entry(argv)
        message = str(err.value)
        assert message.startswith("3 problems with this configuration"), message
        assert "Did you mean optim.warmup?" in message
        assert "steps takes an integer, not 'ten'" in message and "gc_every=-1" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", ["llama_1b", "debug"])
def test_a_missing_data_root_is_said_once(tmp_path, preset):
    """Issue 58: no follow-on "the corpus in . has no usable line in its 0 *.jsonl files" for an
    unset data.root (llama_1b's), nor for one that does not exist."""
    from apps.llama.train import load_config

    root = "" if preset == "llama_1b" else str(tmp_path / "nowhere")
    with pytest.raises(ConfigError) as err:
        load_config([f"config={preset}", f"dump_dir={tmp_path / 'run'}", "data.format=jsonl",
                     f"data.root='{root}'"])
    message = str(err.value)
    assert "usable line" not in message, message
    assert (f"data.root={root} does not exist" if root else "data.root is not set") in message
