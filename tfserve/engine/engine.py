"""The engine's import path as it has always been: `from tfserve.engine.engine import Engine`.

The engine lives in rooms of its own: `core.py` (the step loop), `admission.py` (requests in), `loading.py`
(`Engine.from_pretrained`), `postprocess.py` (tokens out), `offline.py` (`generate_batch`), and `client.py`
(what the layers above see of it).
"""

from tfserve.engine.admission import sampling_defaults
from tfserve.engine.core import Engine
from tfserve.engine.loading import worker_spec

__all__ = ["Engine", "sampling_defaults", "worker_spec"]
