"""One recorded run at a time in a process.

A run changes process-wide state for its length: the model's tensors are swapped for stand-ins and put back, and
torch's ``Function.apply``, ``torch.get_rng_state``, ``UntypedStorage.resize_``, the device meta tensors are
recorded as, the module hooks and the random number generators are replaced, set or put back as the run found
them (``_torch_compat.py``, ``engine/metadata.py``, ``engine/snapshot.py``). Two runs overlapping in two threads
would put back each other's replacements (the later one to begin found the earlier one's, and leaves it installed
for good), record the other's device, or snapshot and restore a model the other has swapped. So a run holds
:data:`RECORDING`, and so does the in-process shared store while it keys a call, records it and keeps the trace
(a key made while another thread's run has swapped the model would name its stand-ins): analyses in several
threads run one after another, each as it would alone. Re-entrant: a recording inside an analysis of the same
thread (the shared store's, then the run's) takes it again."""

from __future__ import annotations

import threading

#: Held by a recorded run (``engine/tracer.py``) and by the shared store's look-up-or-record (``cache/shared.py``).
RECORDING = threading.RLock()
