"""Launch grants, signed: what Resume may run cannot be written behind the server's back.

A grant (table launch_grants) is the command, cwd and checkpoints path that a trainer holding
the launch token sent. Whoever can write the database without that token — another user who
planted the SQLite file or its WAL, a PostgreSQL role with write access — could otherwise
rewrite it and have the owner's Resume run their command. So each grant carries an HMAC over
the run id, command, cwd and checkpoints path, keyed by a key derived from the launch token
(never stored): a grant is verified before each launch, and one that does not verify, or
whose run no longer shows the granted command, is refused (403) with a log line.

A grant made by an earlier release (no MAC) or under another launch token does not verify:
the trainer's next run_start with the launch token grants it again.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from sqlalchemy.engine import Connection

from .messages import RunStart

KEY_CONTEXT = b"nanotron-dashboard launch grant v1"


class GrantSigner:
    """Signs and verifies grants with a key derived from the launch token."""

    def __init__(self, launch_token: str | None) -> None:
        self._key = (
            hmac.new(launch_token.encode(), KEY_CONTEXT, hashlib.sha256).digest()
            if launch_token
            else None
        )

    def mac(self, run_id: str, command: str, cwd: str | None, ck_root: str | None) -> str:
        if self._key is None:
            raise ValueError("no launch token: nothing can be granted")
        msg = json.dumps([run_id, command, cwd, ck_root]).encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def verify(
        self, run_id: str, command: str, cwd: str | None, ck_root: str | None, mac: str | None
    ) -> bool:
        if self._key is None or not mac:
            return False
        return hmac.compare_digest(mac.encode(), self.mac(run_id, command, cwd, ck_root).encode())


def grant_job(m: RunStart, signer: GrantSigner) -> object:
    """A writer job, queued after a run_start sent with the launch token: grant that run's
    command if the stored one is the one this trainer sent (a refused 409 grants nothing)."""
    sent = (json.dumps(m.command), m.cwd, m.checkpoints_path)

    def job(conn: Connection) -> bool:
        row = conn.exec_driver_sql(
            "SELECT pk, command, cwd, checkpoints_path FROM runs WHERE id=?", (m.run_id,)
        ).first()
        if row is None or tuple(row[1:]) != sent or not m.command:
            return False
        conn.exec_driver_sql(
            "INSERT INTO launch_grants(run_pk, command, cwd, checkpoints_path, mac) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(run_pk) DO UPDATE SET command=excluded.command, "
            "cwd=excluded.cwd, checkpoints_path=excluded.checkpoints_path, mac=excluded.mac",
            (row[0], *sent, signer.mac(m.run_id, *sent)),
        )
        return True

    return job


def tampered(
    signer: GrantSigner, run_id: str, run_row: tuple, grant_row: tuple, mac: str | None
) -> str | None:
    """Why this grant may not be trusted (None: it may). run_row and grant_row are each
    (command JSON, cwd, checkpoints path): the run's and its grant's."""
    if not signer.verify(run_id, *grant_row, mac):
        return (
            "its launch grant does not carry a valid signature under this launch token (it "
            "was changed outside the dashboard, made by an earlier release, or under another "
            "launch token); start its trainer again with the launch token to grant it anew"
        )
    if tuple(run_row) != tuple(grant_row):
        return (
            "the run's stored command, cwd or checkpoints path differ from what was granted "
            "(the database was changed outside the dashboard)"
        )
    return None
