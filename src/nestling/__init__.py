"""nestling: train EAGLE-3 draft models for a target LLM and ship them to vLLM and SGLang.

The public API is one function per pipeline stage:

    from nestling import prepare_data, capture, train, export, evaluate, regenerate, run

They are imported eagerly: several share their name with the stage's subpackage
(`nestling.capture`, `nestling.train`, ...), and Python rebinds a package attribute to the
subpackage when it is first imported, so a lazy lookup would hand back a module instead of the
function. Importing the stages here first, then binding the functions, makes the names stable.
"""

from __future__ import annotations

__version__ = "0.1.0"

from nestling.data.prepare import prepare_data  # noqa: E402
from nestling.capture.run import capture  # noqa: E402
from nestling.train.loop import train  # noqa: E402
from nestling.export.eagle3 import export  # noqa: E402
from nestling.evaluate.run import evaluate  # noqa: E402
from nestling.regenerate.run import regenerate  # noqa: E402
from nestling.pipeline import run  # noqa: E402

__all__ = ["prepare_data", "capture", "train", "export", "evaluate", "regenerate", "run", "__version__"]
