"""Checkpoints of a sharded trainer: torch distributed checkpoints, and a Hugging Face export.

- ``save_dcp`` / ``load_dcp``: model *and* AdamW state as a torch.distributed.checkpoint (DCP)
  folder. Every rank writes only its own shards, in parallel, never gathering the whole model in
  one process; DCP records the global layout, so a checkpoint loads into a group of another size.
  (Across hosts, ``path`` must be on a file system every rank sees.)
- ``export_hf``: the full weights gathered on rank 0 and written as a Hugging Face folder
  (``model.safetensors`` + ``config.json`` + generation config + the tokenizer files of the model
  the run started from), which ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load.

Every function here is collective: all ranks call it, in the same order.

Loading reads no pickle that can run code: DCP's ``.metadata`` (a pickle) goes through an unpickler
that resolves only DCP's own metadata classes, torch dtypes and sizes, and paths
(``_MetadataUnpickler``); its byte items (optimizer hyper-parameters) load with
``torch.load(weights_only=True)``, as its tensors already do. Given the verified manifest's file
table (a checkpoint's ``trainer/`` folder), every file DCP opens is read once into memory and
hashed before it is parsed (``flash.checkpoint_trust.read_verified``): a file replaced after the
driver's check is refused by name, never loaded. Each rank holds one file's bytes at a time.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from flash.staging import HostStager


def full_state_dict(model) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict on rank 0 (CPU tensors, every key the plain model has); None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in sd.items()} if dist.get_rank() == 0 else None


def save_dcp(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP metadata is made of; any other global is refused, never imported."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    GLOBALS = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }

    def find_class(self, module: str, name: str):
        if module in self.MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING":
                return obj
        elif (module, name) in self.GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint never holds")


def _verified_fs(root: Path, files: Mapping[str, dict]):
    """A DCP file system whose reads are ``read_verified`` bytes of the files under ``root``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from flash.checkpoint_trust import read_verified

    class VerifiedFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode: str):
            if mode != "rb":
                raise ValueError(f"a checkpoint being loaded is read only (DCP asked to open {path} with {mode!r})")
            yield io.BytesIO(read_verified(root, Path(path).relative_to(root).as_posix(), files))

    return VerifiedFileSystem()


def _safe_reader_and_planner(path: str, files: Mapping[str, dict] | None = None):
    """A DCP reader whose metadata goes through ``_MetadataUnpickler`` and a planner whose byte
    items load with ``weights_only=True`` (torch's own defaults unpickle both freely); with
    ``files``, the reader's bytes are the verified ones (``_verified_fs``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.storage import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    reader = Reader(path)
    if files is not None:
        reader.fs = _verified_fs(Path(reader.path), files)
    return reader, Planner()


def load_dcp(model, optimizer, path: str, files: Mapping[str, dict] | None = None) -> None:
    """Load model and optimizer state saved by ``save_dcp`` (any world size) into the live shards.
    ``files``: the verified manifest's table of this folder (names relative to it); a file whose
    bytes are not the listed ones raises ``CheckpointChanged``. None: a ``save`` folder (no manifest)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from flash.checkpoint_trust import CheckpointChanged

    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(
            f"no torch distributed checkpoint at {path} (missing .metadata); "
            "pass the folder that TrainerGroup.save wrote"
        )
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    reader, planner = _safe_reader_and_planner(path, files)
    reader.read_metadata()  # a refused global raises here, by name (inside dcp.load it is wrapped per rank)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointException as exc:  # a changed file, by name, not a per-rank traceback
        changed = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointChanged)]
        if changed:
            raise changed[0] from None
        raise
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def snapshot_dcp(model, optimizer, stager: HostStager | None = None) -> dict:
    """This rank's shards of model and optimizer state, copied between steps into host memory (no
    communication: each rank copies only what it holds; ``stager``: the rank's own, whose pinned
    buffers the next snapshot reuses), for ``save_snapshot`` to write while training goes on."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return (stager or HostStager()).stage({"model": msd, "optim": osd})


def save_snapshot(state: dict, path: str, process_group) -> None:
    """Write a ``snapshot_dcp`` copy as a DCP folder (the layout ``load_dcp`` reads, any world
    size). ``process_group``: a group of its own, so the save's collectives (plan exchange,
    barrier) run beside the training collectives of the default group instead of interleaving
    with them. Files are fsynced (DCP's ``sync_files``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, process_group=process_group)


def export_hf(model, path: str, tokenizer_source: str | None) -> dict | None:
    """Write a Hugging Face folder at ``path`` from rank 0; returns what was written (rank 0 only).

    Tensors are saved as they are in the state dict (tied weights included once per key, as the
    plain model's ``state_dict`` lists them); ``from_pretrained`` re-ties them.
    """
    from safetensors.torch import save_file

    sd = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    return {"path": str(out), "tensors": len(sd), "tokenizer": _copy_tokenizer(tokenizer_source, out)}


def _copy_tokenizer(source: str | None, out: Path) -> bool:
    """Save the start model's tokenizer beside the weights; False (reported) when it has none."""
    if not source:
        return False
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return False
    tokenizer.save_pretrained(out)
    return True
