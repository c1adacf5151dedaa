"""Zip reading and writing that copies unchanged members without recompressing.

The CUDA base is 248 MB; recompressing it costs tens of seconds, copying its
compressed members verbatim costs about a second. `zipfile` has no public API
for raw copies, so this module writes local headers, central directory and
end record itself (no zip64: wheels of this size never need it).
"""

from __future__ import annotations

import dataclasses
import struct
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_MAX32 = 0xFFFFFFFF
_UNIX_FILE = 0o100644 << 16
_VERSION_MADE_BY = (3 << 8) | 20  # unix, spec 2.0


@dataclasses.dataclass
class Member:
    name: str
    method: int
    dos_time: int
    dos_date: int
    crc: int
    compressed: bytes
    size: int
    external_attr: int


def read_members(path: Path) -> tuple[zipfile.ZipFile, list[zipfile.ZipInfo]]:
    archive = zipfile.ZipFile(path)
    return archive, archive.infolist()


def raw_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, new_name: str | None = None) -> Member:
    fp: BinaryIO = archive.fp  # type: ignore[assignment]
    fp.seek(info.header_offset)
    header = _LOCAL.unpack(fp.read(_LOCAL.size))
    fp.seek(header[9] + header[10], 1)  # file name + extra field
    data = fp.read(info.compress_size)
    dos_time, dos_date = _dos_datetime(info.date_time)
    return Member(
        new_name or info.filename,
        info.compress_type,
        dos_time,
        dos_date,
        info.CRC,
        data,
        info.file_size,
        info.external_attr or _UNIX_FILE,
    )


def new_member(name: str, data: bytes, date_time: tuple[int, ...], mode: int = 0o644) -> Member:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
    compressed = compressor.compress(data) + compressor.flush()
    dos_time, dos_date = _dos_datetime(date_time)
    return Member(
        name,
        zipfile.ZIP_DEFLATED,
        dos_time,
        dos_date,
        zlib.crc32(data),
        compressed,
        len(data),
        (0o100000 | mode) << 16,
    )


def _dos_datetime(date_time: tuple[int, ...]) -> tuple[int, int]:
    year, month, day, hour, minute, second = date_time[:6]
    return (hour << 11) | (minute << 5) | (second // 2), ((year - 1980) << 9) | (month << 5) | day


def write_zip(path: Path, members: list[Member]) -> None:
    central = bytearray()
    with open(path, "wb") as out:
        for member in members:
            offset = out.tell()
            name = member.name.encode("utf-8")
            flags = 0x800  # names are UTF-8
            if offset > _MAX32 or len(member.compressed) > _MAX32 or member.size > _MAX32:
                raise ValueError(f"{path}: {member.name} needs zip64, which is not supported")
            out.write(
                _LOCAL.pack(
                    0x04034B50,
                    20,
                    flags,
                    member.method,
                    member.dos_time,
                    member.dos_date,
                    member.crc,
                    len(member.compressed),
                    member.size,
                    len(name),
                    0,
                )
            )
            out.write(name)
            out.write(member.compressed)
            central += _CENTRAL.pack(
                0x02014B50,
                _VERSION_MADE_BY,
                20,
                flags,
                member.method,
                member.dos_time,
                member.dos_date,
                member.crc,
                len(member.compressed),
                member.size,
                len(name),
                0,
                0,
                0,
                0,
                member.external_attr,
                offset,
            )
            central += name
        start = out.tell()
        if len(members) > 0xFFFF or start > _MAX32:
            raise ValueError(f"{path}: too many members for a zip without zip64")
        out.write(central)
        out.write(_END.pack(0x06054B50, 0, 0, len(members), len(members), len(central), start, 0))
