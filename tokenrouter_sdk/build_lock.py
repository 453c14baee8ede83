"""The lock every model build in this process holds.

Building a model changes state that torch and transformers keep for the whole process, not per
thread: ``from_pretrained(dtype=...)`` sets torch's default dtype for the duration of the load,
and empty-weight initialisation (accelerate's ``init_empty_weights``) patches
``torch.nn.Module.register_parameter``. Two threads building at once (two sub-servers in threads,
or a sub-server and the caller's thread) each save the other's temporary value and restore it,
so the process keeps a float64 default dtype or meta-device parameters after both are done.
Holding `MODEL_BUILD` around every build (`tokenrouter_sdk.engine.runner.build_runner`,
`tokenrouter_sdk.models.load_model`) serialises them; it is re-entrant, so a build that loads a
model takes it once more without waiting on itself.
"""

import threading

MODEL_BUILD = threading.RLock()
