"""`data.format=parquet`: the "text" column of `*.parquet` files read as jsonl is (sources, rank r's
rows r, r + dp, ..., packing, the bad-row rule), a row group at a time. pyarrow is imported here."""

from pathlib import Path

import numpy as np

from lingua.data.jsonl import BadLine, JsonlLoader, JsonlSource
from lingua.errors import ConfigError

COLUMN = "text"


def parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("data.format=parquet reads *.parquet files with pyarrow, which is not "
                          "installed: `pip install pyarrow==26.0.1` (or `pip install -e "
                          "'.[data]'`).") from None
    return pyarrow.parquet


class ParquetSource(JsonlSource):
    """A JsonlSource of rows: its state's offset is the row number in the file."""
    PATTERN, ROW = "*.parquet", f'a non-empty string in the "{COLUMN}" column of every row'

    def __init__(self, *args):
        super().__init__(*args)
        self.group_starts = {}   # path -> its row groups' first rows, its row count last
        self.group = (None, [])  # ((path, row group), its values) read last

    def read(self, path: Path, row: int):
        """(value, the next row number) of each row of `path` from `row` on."""
        if path not in self.group_starts:
            meta = parquet().ParquetFile(path).metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self.group_starts[path] = np.cumsum([0] + sizes).tolist()
        starts = self.group_starts[path]
        for g in range(int(np.searchsorted(starts, row, side="right")) - 1, len(starts) - 1):
            if self.group[0] != (path, g):
                table = parquet().ParquetFile(path).read_row_group(g, columns=[COLUMN])
                self.group = (path, g), table.column(0).to_pylist()
            for r in range(max(row, starts[g]), starts[g + 1]):
                yield self.group[1][r - starts[g]], r + 1

    @staticmethod
    def decode(value) -> str:
        if not isinstance(value, str):
            what = "null" if value is None else f"a {type(value).__name__}"
            raise BadLine("no_text", f'"{COLUMN}" is {what}, not a string')
        if not value:
            raise BadLine("empty", "empty text")
        return value


class ParquetLoader(JsonlLoader):
    name, SOURCE = "parquet", ParquetSource

    @classmethod
    def validate(cls, args, root: Path) -> None:
        super().validate(args, root)
        for path in sorted(root.rglob("*.parquet")):
            try:
                names = parquet().read_schema(path).names
            except (OSError, ValueError) as err:   # pyarrow's ArrowIOError, ArrowInvalid
                raise ConfigError(f"{path} is not a parquet file ({err}). Fix or remove it.") \
                    from None
            if COLUMN not in names:
                raise ConfigError(f"{path} has no \"{COLUMN}\" column, only {names}. Write the "
                                  f"documents' text in a \"{COLUMN}\" column.")
