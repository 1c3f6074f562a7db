"""The KV store: one root on any pyarrow filesystem, every byte through `Blobs`. The manifest, three
part-logged tables (index, chunks, quarantine), content-addressed safetensors shards and their KV formats,
how an entry is built and named, serving generations (records, snapshot dirs, publishing, the part check),
the write lease and serving leases, garbage collection, hot reload, the catalog routing reads (`catalog/`),
and the consistency check and its repairs (`check/`)."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "blobs": ["Blobs", "StoreError"],
    "entries": [
        "PageImageError", "PageImageRefused", "TEXT_SOURCED", "build_sized_entry", "compile_entries", "decode_png",
        "encode_png", "index_row", "page_image_file", "page_images"
    ],
    "filesystem": ["resolve_filesystem"],
    "gc": ["collect_generations", "remove_orphans"],
    "generations": ["current_generation_number", "read_generation"],
    "kv_quant": ["QuantizedKV", "check_device", "dequantize", "stored"],
    "leases": ["LeaseKeeper", "StoreBusyError", "StoreLease"],
    "parts": ["parts_checks", "require_recorded_parts"],
    "publish": ["ensure_generation", "publish_generation"],
    "reload": ["GenerationWatcher", "acquire_current"],
    "seal": ["SealError", "check_seal", "hmac_key", "write_seal"],
    "snapshots": ["local_copy"],
    "shards": ["ShardCorruptError", "ShardReader", "write_shard"],
    "slots": ["entry_slots", "required_keys", "slot_name"],
    "store": ["Store"],
    "writeback": ["write_back", "written_back"],
})
