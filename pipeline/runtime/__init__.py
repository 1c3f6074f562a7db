"""The VLM runtime both paths share: loading a model (or building a tiny or real-shape offline one), compiling
a chunk's KV under the chat-template prefix, re-anchoring and assembling linked chunks (M-RoPE), the fused and
compiled forwards, selective recompute; and what both paths compute beside the model — the page renderer, the
vision-token estimator, the text embedder, OCR, and the one dtype map. What batches and schedules requests over
this runtime is serving's alone: serve/engine/."""

from pipeline.facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "adapters": ["ChatTemplate", "family_classes"],
    "conversation": ["ChatPart", "ChatTurn", "ConversationError", "PreparedSegment", "decode_image", "pil_image",
                     "prepare_segment", "render_layout"],
    "dtypes": [
        "DTYPE_OF", "PAYLOAD_DTYPES", "PAYLOAD_MAX", "SCALE_DTYPE", "StoredFormat", "TORCH_DTYPES",
        "stored_format"
    ],
    "embed": ["EmbedRuntime", "Embedder"],
    "kv": ["AssembledContext", "ChunkKV"],
    "checkpoint": ["check_store", "model_identity", "resolve_device", "resolve_path"],
    "model": ["VLM"],
    "sampling": ["adjust_logits", "ban_tokens", "choose_token", "sampling_distribution", "select_token",
                 "token_logprobs", "token_mask"],
    "ocr": ["OcrUnavailable", "PageLayout", "normalise", "page_legibility", "read_text"],
    "selective_recompute": ["ChunkInputs", "chunk_inputs", "input_embeddings", "recompute"],
    "real_shapes": ["REAL_SHAPES", "Width", "ensure_real_shape"],
    "render": ["Renderer"],
    "tiny": ["ensure_model"],
    "tiny_tokenizer": ["GLM_CHAT_TEMPLATE", "GLM_SPECIALS", "QWEN_CHAT_TEMPLATE", "QWEN_SPECIALS", "build_tokenizer"],
    "tokens": ["MERGE_SIZE", "vision_grid", "vision_tokens"],
    "timing": ["ms_since", "wait_for"],
    "threads": ["in_passing_thread", "off_loop", "serial_here"],
})
