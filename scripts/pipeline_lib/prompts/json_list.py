"""A JSON list of objects read record by record (json.JSONDecoder.raw_decode over a buffered
byte stream), so that a file cut off mid-record - the packaged ShareGPT file ends 125.5 MB
into a larger document - yields every whole record before the cut, and the loss is measured
(bytes after the last whole record) instead of the file being refused as a whole. A record
that is malformed before the end of the data is still an error naming its byte offset."""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import PipelineError

CHUNK_BYTES = 1 << 20
BOM = codecs.BOM_UTF8
WHITESPACE = " \t\r\n"


@dataclass
class JsonListRead:
    """What reading one JSON list found: whole records, whether the list was closed, and
    where the last whole record ended (bytes)."""
    path: Path
    records: int = 0
    complete: bool = False
    end_of_last_record: int = 0
    file_bytes: int = 0

    def loss(self) -> dict[str, Any]:
        """The summary's record of the read: whole records, and (cut off) what was lost at the cut."""
        if self.complete:
            return {"records_read": self.records, "truncated": False}
        lost = self.file_bytes - self.end_of_last_record
        return {"records_read": self.records, "truncated": True, "file_bytes": self.file_bytes,
                "bytes_read": self.end_of_last_record, "bytes_lost": lost,
                # The record the cut went through; how many followed it in the original is unknown.
                "partial_records_lost": 1}


# An error this close to the end of the data may be the data ending (a chunk boundary or the
# cut inside a \uXXXX escape or a literal), not a malformed record.
NEAR_END = 16


def _ran_out(err: json.JSONDecodeError, text: str) -> bool:
    """True when decoding failed because the data ended, not because it is malformed."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip(WHITESPACE)) - NEAR_END


class JsonListStream:
    """Iterate the objects of a JSON list file; `read` holds the counts as iteration goes."""

    def __init__(self, path: Path, setting: str):
        self.path = Path(path)
        self.setting = setting
        self.read = JsonListRead(self.path)

    def __iter__(self) -> Iterator[dict]:
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")()
        self.read.file_bytes = self.path.stat().st_size
        with open(self.path, "rb") as f:
            buf, pos = "", 0       # decoded text not yet consumed starts at buf[pos]
            mark = [0, 0]          # (index into buf, its byte offset in the file): offsets count forward from it
            eof = False

            def offset(i: int) -> int:
                """Byte offset in the file of buf[i] (i at or after the mark, which moves there)."""
                mark[1] += len(buf[mark[0]:i].encode("utf-8"))
                mark[0] = i
                return mark[1]

            def more() -> bool:
                nonlocal buf, pos, eof
                if eof:
                    return False
                chunk = f.read(CHUNK_BYTES)
                if mark[1] == 0 and not buf and chunk.startswith(BOM):
                    chunk, mark[1] = chunk[len(BOM):], len(BOM)
                try:
                    text = utf8.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    if not chunk and err.reason == "unexpected end of data":  # the cut split a character
                        text = ""
                        eof = True
                        mark[:] = [0, offset(pos)]
                        buf, pos = buf[pos:], 0
                        return False
                    at = f.tell() - len(chunk) + err.start
                    raise PipelineError(f"{self.path}: byte {at} is not UTF-8 ({err.reason}); the file must "
                                        f"be UTF-8 JSON ({self.setting}.source)") from None
                eof = not chunk
                # Drop what is consumed, keeping byte offsets exact.
                mark[:] = [0, offset(pos)]
                buf, pos = buf[pos:] + text, 0
                return not eof or bool(text)

            def skip_ws() -> bool:
                """Advance to the next non-space character; False at the end of the data."""
                nonlocal pos
                while True:
                    while pos < len(buf) and buf[pos] in WHITESPACE:
                        pos += 1
                    if pos < len(buf):
                        return True
                    if not more():
                        return False

            if not skip_ws() or buf[pos] != "[":
                raise PipelineError(f"{self.path}: {self.setting}.allow_truncated reads a JSON list of records; "
                                    f"this file does not start with '['")
            pos += 1
            while True:
                if not skip_ws():
                    return  # cut off between records
                if buf[pos] == "]":
                    self.read.complete = True
                    return
                if self.read.records:
                    if buf[pos] != ",":
                        self._malformed(offset(pos), f"expected ',' or ']', got "
                                        f"{buf[pos]!r}")
                    pos += 1
                    if not skip_ws():
                        return
                while True:
                    try:
                        obj, end = decoder.raw_decode(buf, pos)
                        break
                    except json.JSONDecodeError as err:
                        if not _ran_out(err, buf):
                            self._malformed(offset(err.pos), err.msg)
                        if not more():
                            return  # cut off inside this record
                if not isinstance(obj, dict):
                    raise PipelineError(f"{self.path} record {self.read.records}: expected an object, got "
                                        f"{type(obj).__name__}; fix or remove the record")
                pos = end
                self.read.records += 1
                self.read.end_of_last_record = offset(end)
                yield obj

    def _malformed(self, offset: int, why: str) -> None:
        raise PipelineError(f"{self.path}: not valid JSON at byte {offset} after {self.read.records} whole "
                            f"record(s) ({why}); only a file cut off at its end is read up to its last whole "
                            f"record ({self.setting}.allow_truncated)")
