"""Moving trainer weights to the rollout engines.

- ``model_update``: the transports (gloo/NCCL broadcast, shared memory, CUDA IPC, object store) and
  their process groups; ``shm``: the shared-memory path; ``cuda_ipc``: the same on one GPU (a CUDA
  buffer the replicas map by IPC handle); ``group``: the model-update group that pushes a state dict
  from the trainer to every engine replica (sender and receiver hooks);
- ``gather``: an FSDP2 model's full state dict on rank 0 in a few flat gathers.

The lowest component: imported by ``flash.engine`` and ``flash.train``; imports only the shared
``flash`` modules.
"""
