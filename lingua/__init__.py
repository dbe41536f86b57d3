"""lingua: the shared core (model, parallelism, training, evaluation, launch). Importing it silences
three harmless messages (each filter names its own): torchao's optional CUDA kernels, Triton
missing on a CPU build, torch deprecating torchao's Enum registration."""

import logging


class _DropMessages(logging.Filter):
    def __init__(self, *needles: str):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(needle in message for needle in self.needles)


logging.getLogger("torchao").addFilter(_DropMessages("Failed to load", "torchao", "_C_"))
logging.getLogger("torchao.kernel.intmm").addFilter(_DropMessages("Detected no triton"))
logging.getLogger("torch.utils._pytree").addFilter(
    _DropMessages("is an Enum subclass and is now natively supported by torch.compile"))
