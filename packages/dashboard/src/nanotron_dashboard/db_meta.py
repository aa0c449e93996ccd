"""The schema's metadata and the column type of a trainer's numbers, shared by db.py's tables
and db_telemetry.py's."""

from __future__ import annotations

from sqlalchemy import BigInteger, Integer, MetaData

metadata = MetaData()
# 64-bit where a trainer's numbers go (steps, tokens, bytes): SQLite's INTEGER already is;
# PostgreSQL's is 32-bit. The SQLite DDL stays what earlier releases wrote.
Int64 = Integer().with_variant(BigInteger(), "postgresql")
