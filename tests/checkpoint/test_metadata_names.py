"""DCP's .metadata names each item's file; load_metadata checks each distinct name once (thousands of items
name a handful of files), and an escaping name among many safe ones is still refused."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

from resilient.checkpoint.api import UnsafeCheckpointError
from resilient.checkpoint.format.safe import load_metadata


def _metadata(paths: list[str]) -> bytes:
    sdm, storage = {}, {}
    for i, p in enumerate(paths):
        fqn = f"w{i}"
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                         [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
        storage[MetadataIndex(fqn, [0])] = _StorageInfo(p, 64 * i, 64)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, storage_data=storage))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["../escape.distcp", "/abs/path.distcp", "sub/dir.distcp"])
@pytest.mark.parametrize("where", [0, 500, 999])
def test_an_escaping_name_among_many_safe_ones_is_refused(bad: str, where: int) -> None:
    paths = ["__0_0.distcp"] * 1000
    paths[where] = bad
    with pytest.raises(UnsafeCheckpointError, match="escapes the checkpoint directory"):
        load_metadata(_metadata(paths), what=".metadata")


@pytest.mark.timeout(30)
def test_many_items_in_few_files_load() -> None:
    md = load_metadata(_metadata(["__0_0.distcp", "__1_0.distcp"] * 500), what=".metadata")
    assert {i.relative_path for i in md.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
    assert len(md.state_dict_metadata) == 1000
