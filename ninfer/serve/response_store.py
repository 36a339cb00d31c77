"""In-process LRU store of terminal Responses, bounded by record count and serialized bytes.

A record keeps the wire body (for GET), the conversation items that produced it (for
`input_items` and for a child's `previous_response_id`) and the thinking option a child inherits.
Everything is lost on restart. Only the event loop touches the store, so it needs no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from ninfer.serve.errors import invalid


@dataclass(slots=True)
class StoredResponse:
    response: dict
    input_items: list[dict]  # previous context + this request's input (instructions excluded)
    preserve_thinking: bool
    size_bytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.size_bytes:
            text = json.dumps([self.response, self.input_items], ensure_ascii=False)
            self.size_bytes = len(text.encode())

    @property
    def id(self) -> str:
        return self.response["id"]

    def context_items(self) -> list[dict]:
        """What a child request continues from: the inputs, then this response's output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    def __init__(self, max_records: int = 1024, max_bytes: int = 256 << 20) -> None:
        if max_records < 1 or max_bytes < 1:
            raise ValueError("response store limits must be positive")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def put(self, record: StoredResponse) -> None:
        """Store `record`, evicting the least recently used ones to make room."""
        if record.size_bytes > self.max_bytes:
            raise invalid(
                f"response of {record.size_bytes} bytes exceeds the response store capacity of "
                f"{self.max_bytes} bytes",
                "response_store_capacity_exceeded",
                "store",
            )
        self.delete(record.id)
        while self._records and (
            len(self._records) >= self.max_records
            or self._bytes + record.size_bytes > self.max_bytes
        ):
            _, evicted = self._records.popitem(last=False)
            self._bytes -= evicted.size_bytes
        self._records[record.id] = record
        self._bytes += record.size_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self._bytes -= record.size_bytes
        return True
