"""Errors for bad user input, and how their message reaches the person once: under torchrun
every rank usually hits it, so `report` prints it once (the first rank claims it in the TCP
store) and writes the rank's TORCHELASTIC_ERROR_FILE, so torchrun's summary prints it too."""

import datetime
import json
import os
import sys
import time


class ConfigError(ValueError):
    pass


class RunError(RuntimeError):
    """A run stopped for a reason outside the code (full disk, lost rank, non-finite values): the
    message says what happened, what is safe on disk and how to go on. Printed with no traceback."""


# A rank's wait on torchrun's store (the agent's, alive while any worker is) for an earlier report.
STORE_TIMEOUT_S = 10


def report(message: str) -> None:
    """Print `message` once for the job, and make it the failure torchrun reports for this rank."""
    rank = os.environ.get("RANK", "0")
    now = time.time()
    first = _first_report(rank, message, now)
    if first is None:
        print(message, file=sys.stderr, flush=True)
        return
    first_rank, first_time = first
    # Later than the first report's: torchrun shows the earliest failure, the message itself.
    _write_error_file(f"the same error as rank {first_rank} (its message is above)",
                      max(now, first_time + 1))


def _first_report(rank: str, message: str, now: float):
    """None when this rank is the one to print `message`; else (rank, time) of the report that
    printed it. The first writes its error file before telling the others, so torchrun finds it."""
    store = _job_store()
    if store is None:
        _write_error_file(message, now)
        return None
    key = f"lingua/error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        if store.add(key + "/count", 1) == 1:
            _write_error_file(message, now)
            store.set(key, json.dumps([rank, now, message]))
            return None
        first_rank, first_time, first_message = json.loads(store.get(key))
    except Exception:   # the store is gone or slow: say it ourselves rather than not at all
        _write_error_file(message, now)
        return None
    if first_message != message:
        _write_error_file(message, now)
        return None
    return first_rank, first_time


def _job_store():
    """torchrun's agent store (None outside torchrun): it works before any process group exists."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:
        return None


def _write_error_file(message: str, timestamp: float) -> None:
    """In the form torch's @record writes, the message where the traceback goes, which is the line
    torchrun's summary prints (the plain {"message": str} form costs two warnings)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": message, "timestamp": str(int(timestamp))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass   # torchrun then shows its generic line; the message is on stderr either way


def record_crash(err: BaseException) -> None:
    """An unexpected exception (a bug, not a ConfigError/RunError) under torchrun: its traceback
    becomes the failure torchrun reports, as torch's @record does. Call inside `except`."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(err)
        except Exception:
            pass
