"""Sample from a checkpoint of the sliding-window fork with the KV cache (the window masks the
cache too): `python -m apps.swa.generate RUN_OR_CHECKPOINT --prompt "Once upon"`."""

from apps.swa.model import SWAArgs, Transformer
from lingua.eval import generation


def main(argv=None) -> None:
    generation.main(argv, "python -m apps.swa.generate", Transformer, SWAArgs)


if __name__ == "__main__":
    main()
