"""Published GPU measurements of KV copies (``data/published/gpu_transfers.csv``), and kvlab's
own CUDA rows in the same shape.

No GPU has run kvlab's sweeps yet, so what GPUs do comes from others: each row of the table is
one number as its source quotes it (the quote is kept beside it), with the source, its link,
the hardware, the link type, the copy mechanism and what was moved. The columns hold only what
the source says; quantities derived from them (bytes from descriptors times their size, or
from a quoted bandwidth times a quoted time) are worked out here, where a reader can see how.
``role`` says what a row is for: ``fit`` (fixes one parameter of the GPU cost model),
``held-out`` (predicted, never fitted), ``context`` (quoted, not a copy the model predicts),
``geometry`` (a segment size kvlab's presets must match) and ``own`` (kvlab's own CUDA rows).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import Any, Iterable

PUBLISHED_CSV = Path(__file__).resolve().parents[2] / "data" / "published" / "gpu_transfers.csv"
COLUMNS = ("id", "source", "url", "hardware", "link_type", "model_link", "mechanism", "transport", "direction", "layout",
           "moved", "descriptors", "descriptors_high", "run_length", "coalesced", "segment_bytes", "bytes", "gbps",
           "gbps_high", "tokens", "block_tokens", "metric", "value", "value_high", "unit", "quote", "role", "note")
ROLES = ("fit", "held-out", "context", "geometry", "own")
MECHANISMS = {
    "dma_batch": "per-descriptor DMA (cuMemcpyBatchAsync)",
    "memcpy_per_segment": "one cudaMemcpyAsync per segment",
    "copy_kernel": "a copy kernel (Triton / CUDA gather)",
    "nixl": "NIXL descriptors",
    "copy_engine": "one contiguous copy (the copy engine's ceiling)",
}
# A quoted unit to SI (seconds, bytes, bytes per second, fractions); KB and MB as the sources
# use them for KV blocks: binary (vLLM's 2 MB block of Llama-3.1-8B is 32 x 64 KiB).
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "GB/s": 1e9, "%": 0.01, "x": 1.0, "B": 1.0, "KB": 1024.0,
         "MB": 1024.0 ** 2, "descriptors": 1.0}
OWN_SOURCE = "kvlab (this project)"
# kvlab's copy methods by the mechanism the GPU model knows them as
OWN_MECHANISMS = {"dma": "dma_batch", "vllm": "dma_batch", "segments": "memcpy_per_segment", "gather": "copy_kernel",
                  "compiled": "copy_kernel", "triton": "copy_kernel", "lmcache": "copy_kernel"}


def _number(text: str) -> float | None:
    return float(text) if text.strip() else None


def _middle(low: float | None, high: float | None) -> float | None:
    """A quoted range by its middle (a single value as it is)."""
    return low if low is None or high is None else (low + high) / 2


@dataclass(frozen=True)
class Measurement:
    """One row of the table: the quoted text fields, and the numbers the model needs."""

    fields: dict[str, str]

    def __getattr__(self, name: str) -> str:  # a column by its name: row.source, row.quote
        fields = self.__dict__.get("fields")
        if fields is None or name not in COLUMNS:
            raise AttributeError(name)
        return fields[name]

    @property
    def scale(self) -> float:
        return UNITS[self.unit]

    @property
    def low(self) -> float:
        return float(self.value) * self.scale

    @property
    def high(self) -> float:
        return (_number(self.value_high) or float(self.value)) * self.scale

    @property
    def quoted(self) -> float:
        """The quoted value in SI units (a range by its middle)."""
        return (self.low + self.high) / 2

    @property
    def descriptors_quoted(self) -> float | None:
        count = _middle(_number(self.descriptors), _number(self.descriptors_high))
        if count is None and self.tokens and self.block_tokens:  # one block per block_tokens tokens
            return float(ceil(float(self.tokens) / float(self.block_tokens)))
        return count

    @property
    def submissions(self) -> float | None:
        """Copies the mechanism issues: the descriptors, or their merged runs where it coalesced them."""
        count = self.descriptors_quoted
        if count is not None and self.coalesced == "yes":
            return count / float(self.run_length or 1)
        return count

    @property
    def nbytes(self) -> float | None:
        """Bytes moved: quoted, else descriptors x their size, else quoted bandwidth x quoted time."""
        if self.bytes:
            return float(self.bytes)
        count, size = self.descriptors_quoted, _number(self.segment_bytes)
        if count is not None and size is not None:
            return count * size
        gbps = _middle(_number(self.gbps), _number(self.gbps_high))
        if gbps is not None and self.unit in ("ms", "s", "us"):
            return gbps * 1e9 * self.quoted
        return None

    @property
    def segment(self) -> float | None:
        """Bytes per submitted copy (merged runs are run_length segments long)."""
        count, total = self.submissions, self.nbytes
        return total / count if count and total is not None else _number(self.segment_bytes)


def check_row(fields: dict[str, str]) -> None:
    """Refuse a row without its source, link, quote, a known role, mechanism and unit, or a number."""
    name = fields.get("id") or "a row without an id"
    for column in ("id", "source", "url", "quote", "metric", "value", "unit", "role"):
        if not (fields.get(column) or "").strip():
            raise ValueError(f"published row {name}: {column} is empty (every row names its source, link and quote)")
    if not fields["url"].startswith(("https://", "data/")):
        raise ValueError(f"published row {name}: url {fields['url']!r} is not a link")
    if fields["role"] not in ROLES:
        raise ValueError(f"published row {name}: role {fields['role']!r} is not one of {ROLES}")
    if fields["mechanism"] and fields["mechanism"] not in MECHANISMS:
        raise ValueError(f"published row {name}: mechanism {fields['mechanism']!r} is not one of {list(MECHANISMS)}")
    if fields["unit"] not in UNITS:
        raise ValueError(f"published row {name}: unit {fields['unit']!r} is not one of {list(UNITS)}")
    for column in ("value", "value_high", "descriptors", "descriptors_high", "run_length", "segment_bytes", "bytes",
                   "gbps", "gbps_high", "tokens", "block_tokens"):
        try:
            _number(fields.get(column) or "")
        except ValueError:
            raise ValueError(f"published row {name}: {column} {fields[column]!r} is not a number") from None


def load_published(path: str | Path = PUBLISHED_CSV) -> list[Measurement]:
    """The table's rows, each checked; ids unique."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path} lacks the columns {sorted(missing)}")
        rows = [Measurement({column: row[column] or "" for column in COLUMNS}) for row in reader]
    seen: set[str] = set()
    for row in rows:
        check_row(row.fields)
        if row.id in seen:
            raise ValueError(f"{path}: the id {row.id} appears twice")
        seen.add(row.id)
    return rows


def model_link_of(hardware: str) -> str:
    """The host link the GPU model assumes for a machine kvlab measured ("cuda: NVIDIA H100 ..."):
    NVLink-C2C on Grace machines (GB200, GH200, GB300), PCIe Gen5 otherwise."""
    return "nvlink_c2c" if any(name in hardware for name in ("GB200", "GH200", "GB300")) else "pcie5"


def own_rows(results: Iterable[dict[str, Any]]) -> list[Measurement]:
    """kvlab's own CUDA transfer rows (notebook 02, ``scripts/device-check``) as table rows:
    held out like the published ones, never fitted, named as this project's measurements."""
    out = []
    for row in results:
        hardware = row.get("hardware") or ""
        if (not hardware.startswith("cuda") or row.get("status") != "ok" or row.get("target", "host") != "host"
                or row.get("method") not in OWN_MECHANISMS):
            continue
        fields = dict.fromkeys(COLUMNS, "")
        fields.update({
            "id": f"kvlab-{row.get('run_id')}-{row['model'].split('/')[-1]}-{row['layout']}-{row['method']}-"
                  f"{row['direction']}-{row['tokens']}-{row.get('block_ids', 'scattered')}",
            "source": OWN_SOURCE, "url": f"data/results/{row.get('source') or '02_transfer'}", "hardware": hardware,
            "link_type": "not recorded", "model_link": model_link_of(hardware),
            "mechanism": OWN_MECHANISMS[row["method"]], "transport": f"kvlab {row['method']}",
            "direction": row["direction"], "layout": row["layout"], "moved": f"{row['tokens']} tokens of {row['model']}",
            "descriptors": str(row["segments"]), "run_length": "1", "coalesced": "no", "bytes": str(row["bytes"]),
            "metric": "time_ms", "value": repr(row["seconds"] * 1e3), "unit": "ms",
            "quote": f"measured by kvlab on {hardware} ({row.get('profile', 'unrecorded')} profile)", "role": "own",
        })
        out.append(Measurement(fields))
    return out
