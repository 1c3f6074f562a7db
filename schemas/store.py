"""Contracts of the KV store: its layout, the manifest, fingerprints, cache keys, and the small result
types the store returns (the tables' Arrow schemas and row rules: schemas/tables.py).

On-disk layout of a store (a local directory or an object-store prefix; every file written atomically):

    manifest.json                  `Manifest`: model fingerprint, page layout, tiers, variants, embedder
    index/part-*.parquet           INDEX_SCHEMA, one row per KV entry (chunk_key, tier, variant, fingerprint)
    chunks/part-*.parquet          CHUNKS_SCHEMA, one row per chunk occurrence (chunk_id)
    quarantine/part-*.parquet      QUARANTINE_SCHEMA, every rejected input with its reason
    shards/<2 hex>/<sha256>.safetensors   KV tensors [layers, 2, kv_heads, tokens, head_dim] (or, in a
                                   store with `kv_quant`, their quantised records); many entries per
                                   file, each found by (byte_offset, nbytes) in its index row
    leases/<job_id>.json           the write lease of the job writing the store (pipeline/store/leases.py)

Tables are append-only part logs (pipeline/store/part_log.py): readers take the newest row per key, and
every job ends by compacting what it appended into parts of ≤250k rows.

Fingerprints are sha256 over canonical JSON (sorted keys, no whitespace) so they are identical in
every process and on every machine; Python's `hash()` is salted per process and never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Mapping

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from schemas.config import DType, KVQuant, ModelFamily
from schemas.frozen import Frozen
from schemas.modes import DUMMY_PREFIX_SEED, AblationTiers, ChunkKind, CompilePrefix, Variant
from schemas.render import RenderSpec, TierSpec

SCHEMA_VERSION = 2  # 2: entries packed in shards, found by byte_offset + shape
ORPHAN_GRACE_S = 3600.0  # a file younger than this may belong to a job still writing: never an orphan yet
HEX64 = re.compile(r"[0-9a-f]{64}")
TIER_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # TierSpec.name's pattern
@dataclass(frozen=True)
class ShardEntry:
    """Where one tensor written to a shard lives; `index_fields()` goes into its index row."""

    tensor_key: str
    shard_path: str  # relative to the store root
    nbytes: int
    checksum: str  # sha256 hex of the tensor's raw bytes
    dtype: DType | KVQuant  # a float tensor, or a quantised record (pipeline/store/kv_quant.py)
    byte_offset: int  # of the tensor's bytes from the start of the shard file
    shape: tuple[int, ...]  # the KV's logical shape (a quantised record's is its KV's, not the record's)

    def index_fields(self) -> dict[str, Any]:
        return {"shard_path": self.shard_path, "tensor_key": self.tensor_key, "nbytes": self.nbytes,
                "checksum": self.checksum, "dtype": self.dtype.value, "byte_offset": self.byte_offset,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class GroupStats:
    tier: str | None
    variant: Variant
    num_entries: int
    nbytes: int


@dataclass(frozen=True)
class StoreStats:
    num_chunks: int  # chunk occurrences
    num_chunk_keys: int  # distinct chunk texts
    num_documents: int
    num_entries: int  # KV entries after dedupe
    num_quarantined: int
    groups: tuple[GroupStats, ...]  # per (tier, variant), sorted


def _canonical_sha256(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def model_fingerprint(model_id: str, revision: str, dtype: DType, template_prefix: str) -> str:
    """What every KV entry of a store depends on: the weights, their dtype and the chat-template prefix."""
    return _canonical_sha256({
        "kind": "qvpic.model", "model_id": model_id, "revision": revision,
        "dtype": DType(dtype).value, "template_prefix": template_prefix,
    })


def entry_fingerprint(model_fp: str, variant: Variant, render: RenderSpec | None, tier: TierSpec | None,
                      kv_quant: KVQuant = KVQuant.NONE) -> str:
    """Fingerprint of one KV entry. Every variant has its own; image variants depend on the page layout
    and the tier's DPI (not on which other tiers exist, nor on the tier's name); text variants ignore
    renderer and tier; the dummy prefix's seed is part of what it was compiled after; a quantised
    entry's format is part of it (unquantised entries keep the fingerprints they always had)."""
    variant = Variant(variant)
    payload: dict[str, Any] = {"kind": "qvpic.entry", "model": model_fp, "variant": variant.value}
    if KVQuant(kv_quant) is not KVQuant.NONE:
        payload["kv_quant"] = KVQuant(kv_quant).value
    if variant.prefix is CompilePrefix.DUMMY:
        payload["dummy_prefix_seed"] = DUMMY_PREFIX_SEED
    if variant.kind is ChunkKind.IMAGE:
        if render is None or tier is None:
            raise ValueError(f"variant {variant.value!r} needs a RenderSpec and a TierSpec to fingerprint")
        payload["render"] = render.model_dump(mode="json", exclude={"tiers"})
        payload["dpi"] = tier.dpi
    return _canonical_sha256(payload)


class CacheKeyError(ValueError):
    """A string or field is not a valid cache key."""


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Identity of one stored KV entry: which chunk text, at which tier, as which variant, for which
    model/render fingerprint. `tier` is None exactly for the text variants."""

    chunk_key: str
    tier: str | None
    variant: Variant
    fingerprint: str

    PREFIX = "kv1"
    NO_TIER = "-"  # cannot be a tier name (those start with a letter)

    def __post_init__(self) -> None:
        for name in ("chunk_key", "fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, str) or not HEX64.fullmatch(value):
                raise CacheKeyError(f"{name} must be 64 lowercase hex digits, got {value!r:.80}")
        if not isinstance(self.variant, Variant):
            raise CacheKeyError(f"variant must be a Variant, got {self.variant!r:.80}")
        if self.variant.kind is ChunkKind.TEXT:
            if self.tier is not None:
                raise CacheKeyError(f"text variant {self.variant.value!r} has no tier, got {self.tier!r:.80}")
        elif not isinstance(self.tier, str) or not TIER_NAME.fullmatch(self.tier):
            raise CacheKeyError(f"variant {self.variant.value!r} needs a tier name, got {self.tier!r:.80}")

    def to_str(self) -> str:
        return "/".join((self.PREFIX, self.chunk_key, self.tier or self.NO_TIER, self.variant.value, self.fingerprint))

    @classmethod
    def parse(cls, text: str) -> "CacheKey":
        if not isinstance(text, str) or len(text) > 256:
            raise CacheKeyError(f"not a cache key string: {text!r:.80}")
        parts = text.split("/")
        if len(parts) != 5 or parts[0] != cls.PREFIX:
            raise CacheKeyError(f"cache key must be '{cls.PREFIX}/chunk/tier/variant/fingerprint', got {text!r:.80}")
        _, chunk_key, tier, variant, fingerprint = parts
        try:
            variant_value = Variant(variant)
        except ValueError:
            raise CacheKeyError(f"unknown variant {variant!r:.40} in cache key") from None
        return cls(chunk_key, None if tier == cls.NO_TIER else tier, variant_value, fingerprint)


class ManifestError(ValueError):
    """A manifest is unreadable, inconsistent or of an unsupported schema version."""


class StoredModel(Frozen):
    """The model a store was compiled for."""

    id: str = Field(min_length=1)
    revision: str = Field(min_length=1)
    dtype: DType
    family: ModelFamily


class Manifest(Frozen):
    """Store-level facts every reader checks before trusting an entry."""

    schema_version: int = SCHEMA_VERSION
    fingerprint: str  # model_fingerprint of `model` + `template_prefix`
    model: StoredModel
    template_prefix: str
    render: RenderSpec  # its `tiers` are the store's tiers
    variants: tuple[Variant, ...] = Field(min_length=1)
    embedder: str = Field(min_length=1)
    embedding_dim: int = Field(gt=0)
    kv_quant: KVQuant = KVQuant.NONE  # how every entry's KV is stored (pipeline/store/kv_quant.py)
    created_at: datetime
    updated_at: datetime
    job_ids: tuple[str, ...] = ()
    # Tiers whose templated entries are compiled on first promotion, by the generator that needs them,
    # instead of at ingest (`qvpic ingest --lazy-high-tier`); never the lowest tier, which backs them up.
    lazy_tiers: tuple[str, ...] = ()
    # The tiers the ablation variants (plain, dummy) are compiled at (`qvpic ingest --ablation-tiers`).
    ablation_tiers: AblationTiers = AblationTiers.LOWEST

    @field_validator("schema_version")
    @classmethod
    def _supported(cls, version: int) -> int:
        if version != SCHEMA_VERSION:
            raise ValueError(f"store schema version {version} is not supported (this build reads {SCHEMA_VERSION})")
        return version

    @model_validator(mode="after")
    def _fingerprint_matches(self) -> "Manifest":
        expected = model_fingerprint(self.model.id, self.model.revision, self.model.dtype, self.template_prefix)
        if self.fingerprint != expected:
            raise ValueError(f"manifest fingerprint {self.fingerprint!r} does not match its model and template prefix")
        names = {t.name for t in self.render.tiers}
        for tier in self.lazy_tiers:
            if tier not in names or tier == self.render.lowest_tier.name:
                raise ValueError(f"lazy tier {tier!r} must be one of the store's tiers above the lowest, "
                                 f"{sorted(names)}")
        return self

    def is_lazy(self, tier: str | None, variant: Variant) -> bool:
        """Whether the (tier, variant) entry is compiled on first use rather than at ingest."""
        return Variant(variant) is Variant.TEMPLATE and tier in self.lazy_tiers

    @classmethod
    def create(cls, model: StoredModel, template_prefix: str, **fields: Any) -> "Manifest":
        """A manifest whose fingerprint is computed from `model` and `template_prefix`."""
        fp = model_fingerprint(model.id, model.revision, model.dtype, template_prefix)
        return cls(fingerprint=fp, model=model, template_prefix=template_prefix, **fields)

    @property
    def tiers(self) -> tuple[TierSpec, ...]:
        return self.render.tiers

    def entry_fingerprint(self, variant: Variant, tier_name: str | None) -> str:
        tier = None if Variant(variant).kind is ChunkKind.TEXT else self.render.tier(tier_name or "")
        return entry_fingerprint(self.fingerprint, variant, self.render, tier, self.kv_quant)

    def check_model(self, model_id: str, revision: str, dtype: DType, template_prefix: str) -> None:
        """Raise `ManifestError` unless the store was compiled for exactly this model and template."""
        fp = model_fingerprint(model_id, revision, dtype, template_prefix)
        if fp != self.fingerprint:
            raise ManifestError(
                f"store was compiled for {self.model.id}@{self.model.revision} ({self.model.dtype.value}), "
                f"fingerprint {self.fingerprint[:12]}; refusing to serve {model_id}@{revision} "
                f"({DType(dtype).value}), fingerprint {fp[:12]}"
            )

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise ManifestError(f"invalid manifest: {e}") from e


def _absolute_dir(path: str) -> str:
    if not os.path.isabs(path):
        raise ValueError(f"images_root must be an absolute path, not {path!r}")
    return path


# The one directory a serving host (or a recompile) reads scanned page images from: a chunk's `image_path` is
# opened only when it resolves (symlinks, `..`) inside it (pipeline/store/entries.py `page_image_file`).
# None: no page image is read at all, and chunks ingested from page images are answered from their KV alone.
ImagesRoot = Annotated[str, AfterValidator(_absolute_dir)]


class StoreSpec(Frozen):
    """Where a store lives. `endpoint_url` (e.g. `http://127.0.0.1:9000`) points S3 URIs at an
    S3-compatible server; when unset, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL are used if present.
    Credentials always come from the environment (AWS_ACCESS_KEY_ID, ...), never from config."""

    uri: str = Field(min_length=1)
    endpoint_url: str | None = Field(None, pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+/?$")
    region: str | None = None
