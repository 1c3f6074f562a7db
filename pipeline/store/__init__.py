"""The KV store: one root on any pyarrow filesystem, every byte through `Blobs`. The manifest, three
part-logged tables (index, chunks, quarantine), content-addressed safetensors shards and their KV formats,
how an entry is built and named, serving generations (snapshots, leases, GC), the catalog routing reads
(`catalog/`), and the consistency check and its repairs (`check/`)."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "blobs": ["Blobs", "StoreError"],
    "entries": [
        "PageImageError", "TEXT_SOURCED", "build_sized_entry", "compile_entries", "decode_png", "encode_png",
        "index_row", "page_images"
    ],
    "filesystem": ["resolve_filesystem"],
    "generations": [
        "collect_generations", "current_generation_number", "ensure_generation", "parts_checks",
        "publish_generation", "read_generation", "require_recorded_parts"
    ],
    "kv_quant": ["QuantizedKV", "check_device", "dequantize", "stored"],
    "lease": ["StoreBusyError", "StoreLease"],
    "reload": ["GenerationWatcher", "LeaseKeeper", "acquire_current"],
    "serving_blobs": ["local_copy"],
    "shards": ["ShardCorruptError", "ShardReader", "write_shard"],
    "slots": ["entry_slots", "required_keys", "slot_name"],
    "store": ["Store"],
    "writeback": ["write_back", "written_back"],
})
