"""Sample types and the SampleBuffer every role exchanges trajectories through."""

from buffers.buffer import BufferClosed, SampleBuffer
from buffers.types import Group, Sample

__all__ = ["BufferClosed", "Group", "Sample", "SampleBuffer"]
