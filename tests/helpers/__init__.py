"""Scaffolding the test modules share, so that no test module imports another:

- ``inproc``: small in-process runs of the default recipe (``small_cfg``) and the plain
  synchronous loop they are compared with;
- ``processes``: ``flash run`` as a subprocess -- launch, kill, resume, read its logs;
- ``models``: tiny models and tokenizers built offline, reference generation;
- ``train``: an FSDP2 trainer group and its batches;
- ``wire``: raw frames for the buffer service;
- ``sandbox``: the processes of code-sandbox calls, and the fixture that none outlives its call.
"""
