"""draftcache store: a zarr v3 cache of target hidden states (see cache_format/README.md)."""

from cache_format.errors import CacheFormatError, ManifestMismatchError, UnknownFormatVersionError
from cache_format.index import finalize_store
from cache_format.reader import Sample, StoreReader
from cache_format.schema import FORMAT_VERSION, DatasetInfo, Manifest, TargetInfo, bucket_of
from cache_format.writer import ShardWriter, create_store, write_frozen, write_prompt_keys

__all__ = [
    "FORMAT_VERSION",
    "CacheFormatError",
    "DatasetInfo",
    "Manifest",
    "ManifestMismatchError",
    "Sample",
    "ShardWriter",
    "StoreReader",
    "TargetInfo",
    "UnknownFormatVersionError",
    "bucket_of",
    "create_store",
    "finalize_store",
    "write_frozen",
    "write_prompt_keys",
]
