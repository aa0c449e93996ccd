"""A real PostgreSQL server for the tests (Debian's package), in a temporary directory.

initdb refuses to run as root: when the tests run as root (development machines and CI),
the server runs as the `postgres` user that Debian's package creates (else `nobody`). It
listens on 127.0.0.1 at a free port with trust authentication and without fsync: a test
server, gone with its directory. Each test gets a database of its own (`fresh_database`).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dashboard_helpers import free_port

_counter = itertools.count()


def find_bin(name: str) -> str | None:
    """Debian keeps the server's programs in /usr/lib/postgresql/<major>/bin (not on PATH)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


@dataclass
class PgServer:
    port: int
    proc: subprocess.Popen
    root: Path  # the data directory, socket and log: removed by stop()
    args: tuple[list[str], dict[str, str], object] = ([], {}, None)  # argv, env, preexec

    def pause(self) -> None:
        """Stop the server as an outage would (fast shutdown: its sessions are cut), keeping
        its data for `resume`."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)

    def resume(self) -> None:
        argv, env, drop = self.args
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=drop, env=env
            )
        _wait_ready(self, self.root / "server.log")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def fresh_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: smart shutdown; the directory is temporary
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


def start() -> PgServer:
    """initdb and start a server in a new directory under /tmp (pytest's own temporary
    folders are root's, mode 700: the server's user could not enter them); RuntimeError
    naming what is missing or what failed."""
    initdb, postgres = find_bin("initdb"), find_bin("postgres")
    if not initdb or not postgres:
        raise RuntimeError(
            "PostgreSQL is not installed (initdb/postgres not found): apt-get install -y "
            "postgresql (make test does)"
        )
    user = _as_user()
    tmp = Path(tempfile.mkdtemp(prefix="nanotron-pg-"))
    data = tmp / "pgdata"
    data.mkdir(mode=0o700)
    if user is not None:
        os.chown(tmp, user.pw_uid, user.pw_gid)
        os.chown(data, user.pw_uid, user.pw_gid)

    def drop() -> None:
        if user is not None:
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)

    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    subprocess.run(
        [initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
        preexec_fn=drop,
        env=env,
        cwd=tmp,
    )
    port = free_port()
    settings = {
        "listen_addresses": "127.0.0.1",
        "port": str(port),
        "unix_socket_directories": str(tmp),
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "200",
    }
    args = [postgres, "-D", str(data)] + [f"-c{k}={v}" for k, v in settings.items()]
    with open(tmp / "server.log", "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=drop, env=env
        )
    server = PgServer(port, proc, tmp, (args, env, drop))
    try:
        _wait_ready(server, tmp / "server.log")
    except RuntimeError:
        server.stop()
        raise
    return server


def _wait_ready(server: PgServer, log: Path) -> None:
    import psycopg

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"PostgreSQL exited: {log.read_text()[-2000:]}")
        try:
            psycopg.connect(server.url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            time.sleep(0.1)
    raise RuntimeError(f"PostgreSQL did not start in 30 s: {log.read_text()[-2000:]}")
