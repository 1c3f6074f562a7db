"""Serving generations of a store: find the current one, read and write their records (the layout is in
schemas/generation.py).

A job publishes a generation at its end (pipeline/store/publish.py: snapshot dirs from
pipeline/store/snapshots.py, then the record, then the pointer); replicas follow the pointer
(pipeline/store/reload.py) under leases (pipeline/store/leases.py); pipeline/store/gc.py removes what no
live generation needs.
"""

from __future__ import annotations

from pydantic import ValidationError

from pipeline.store.seal import write_seal
from pipeline.store.store import Store
from schemas.generation import CURRENT, GENERATIONS_DIR, Generation, generation_path


def current_generation_number(store: Store) -> int | None:
    pointer = store.blobs.get_json(CURRENT)
    return None if pointer is None else int(pointer["generation"])


def read_generation(store: Store, generation: int) -> Generation:
    record = store.blobs.get_json(generation_path(generation))
    if record is None:
        raise FileNotFoundError(f"store {store.uri} has no serving generation {generation}")
    try:
        return Generation.model_validate(record)
    except ValidationError as error:  # a tampered or foreign record: say which field, refuse to serve it
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"store {store.uri}: generation {generation}'s record is refused: {reasons}") from None


def current_generation(store: Store) -> Generation | None:
    number = current_generation_number(store)
    return None if number is None else read_generation(store, number)


def list_generations(store: Store) -> list[int]:
    return sorted(int(i.base_name[:-5]) for i in store.blobs.list(GENERATIONS_DIR)
                  if i.base_name.endswith(".json") and i.base_name[:-5].isdigit())


def write_generation(store: Store, record: Generation, hmac_key: bytes | None = None) -> None:
    """Write `record` (and its seal, with `hmac_key`) and make it current: the pointer moves last, once the
    record is readable and sealed, so a replica checking seals never sees the pointer before the seal."""
    store.blobs.put(generation_path(record.generation), record.model_dump_json(indent=2).encode())
    if hmac_key is not None:
        write_seal(store, record, hmac_key)
    store.blobs.put_json(CURRENT, {"generation": record.generation})  # the switch
