"""What tests/launcher.py's server imports before it forks a rank: what `python -m apps.<app>.train`
imports on its own (nothing more, so that a rank's modules are the ones a real launch has)."""

import apps.llama.train  # noqa: F401
import apps.moe.train  # noqa: F401
