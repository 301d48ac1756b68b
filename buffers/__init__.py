"""Sample types and the SampleBuffer every role exchanges trajectories through: `types` (Sample,
Group, the per-token field table), `codec` (samples as JSON values), `buffer` (the in-process
SampleBuffer), `wire`/`rpc` (msgpack frames), `service`/`store`/`longpoll` (the zmq buffer service),
`producer`/`client` (its two ends), `factory` (transport by config), `reward` (what counts as a
reward), `trace` (a multi-turn sample's tokens as they are built).

A leaf: imports nothing of the project; every layer above may import it.
"""

from .buffer import BufferClosed, SampleBuffer
from .types import Group, Sample

__all__ = ["BufferClosed", "Group", "Sample", "SampleBuffer"]
