"""The loader contract: all the trainer asks of a data format (a file of its own and one line in
lingua.data.FORMATS). cls(data_args, dp_rank, dp_size, seed) reads one data-parallel rank's share:
a step's micro-batches, its exact position, its unusable lines by reason. The class methods run
before any loader exists: the checks at start (ConfigError naming the fix), the validation rows."""

from pathlib import Path
from typing import Dict, List

from lingua.data.batch import Batch


class Loader:
    builds_embedded = False        # data.prepare_embedded builds the debug corpus in this format
    checks_need_tokenizer = True   # validate() loads the tokenizer (plan checks without it if not)

    def next_step(self) -> List[Batch]: raise NotImplementedError
    def state_dict(self) -> dict: raise NotImplementedError
    def load_state_dict(self, state: dict) -> None: raise NotImplementedError
    def skipped(self) -> Dict[str, int]: return dict(self.counter.by_reason)

    @classmethod
    def val_batches(cls, args, dp_rank: int, dp_size: int) -> List[Batch]:
        raise NotImplementedError

    @classmethod
    def validate(cls, args, root: Path) -> None: ...   # cheap checks of the files at root
    @classmethod
    def check_ranks(cls, args, dp_size: int) -> None: ...   # here every rank reads every row
    @classmethod
    def check_model(cls, args, model_args) -> None: ...
