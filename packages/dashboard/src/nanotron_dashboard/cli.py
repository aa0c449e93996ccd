"""`nanotron-dashboard --db runs.db|postgresql://... [--host 127.0.0.1] [--port 8008] [--token-file F] [--allow-launch]
[--alert-webhook URL] [--stall-after SECONDS]`
and `nanotron-dashboard delete-run --db runs.db RUN_ID`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from .errors import DashboardError, StartupConfigError
from .messages import MAX_MESSAGE_BYTES

TOKEN_ENV = "NANOTRON_DASHBOARD_TOKEN"
LAUNCH_TOKEN_ENV = "NANOTRON_DASHBOARD_LAUNCH_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanotron-dashboard", description=__doc__)
    p.add_argument(
        "--db",
        default="runs.db",
        help="SQLite file (created if missing), or a PostgreSQL URL "
        "postgresql://user@host/dbname (a team server; the database must exist)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8008)
    p.add_argument(
        "--token",
        default=None,
        help=f"required for a non-loopback --host; visible in the process list, so prefer "
        f"--token-file or the {TOKEN_ENV} environment variable",
    )
    p.add_argument("--token-file", default=None, help="read the token from this file")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also serve requests for this host name (a reverse proxy's or the machine's DNS "
        "name); the bound host and loopback names always are (repeatable)",
    )
    p.add_argument(
        "--allow-launch",
        action="store_true",
        help=f"enable the Resume button; needs a launch token (--launch-token-file or "
        f"{LAUNCH_TOKEN_ENV}), different from the access token",
    )
    p.add_argument(
        "--launch-token-file",
        default=None,
        metavar="FILE",
        help="the launch token (mode 600): it alone may resume runs, and only runs whose "
        "run_start was sent with it",
    )
    p.add_argument("--stall-seconds", type=float, default=120.0, help="heartbeat age => stalled")
    p.add_argument(
        "--stall-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a running run that sends nothing this long gets one `stall` event per silence",
    )
    p.add_argument(
        "--alert-webhook",
        action="append",
        default=[],
        metavar="URL",
        help="POST each stored event as JSON to this http(s) URL, retried with back-off, from "
        "a background thread (repeatable)",
    )
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def _token_file(path: str, flag: str, private: bool) -> str:
    from .security import check_token

    try:
        if private and os.stat(path).st_mode & 0o077:
            raise StartupConfigError(
                f"{flag} {path}: other users can read it (mode "
                f"{os.stat(path).st_mode & 0o777:o}): chmod 600 {path}"
            )
        text = Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise StartupConfigError(f"{flag} {path}: {e}") from None
    return check_token(text, f"{flag} {path}")


def resolve_token(args: argparse.Namespace) -> str | None:
    """--token, else --token-file, else $NANOTRON_DASHBOARD_TOKEN, else none."""
    from .security import check_token

    if args.token is not None:
        return check_token(args.token, "--token")
    if args.token_file is not None:
        return _token_file(args.token_file, "--token-file", private=False)
    env = os.environ.get(TOKEN_ENV)
    return check_token(env, TOKEN_ENV) if env is not None else None


def resolve_launch_token(args: argparse.Namespace) -> str | None:
    """--launch-token-file (readable by its owner only), else $NANOTRON_DASHBOARD_LAUNCH_TOKEN."""
    from .security import check_token

    if args.launch_token_file is not None:
        return _token_file(args.launch_token_file, "--launch-token-file", private=True)
    env = os.environ.get(LAUNCH_TOKEN_ENV)
    return check_token(env, LAUNCH_TOKEN_ENV) if env is not None else None


def delete_run_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="nanotron-dashboard delete-run",
        description="Delete a run and its series from the database (checkpoint files stay).",
    )
    p.add_argument("--db", required=True)
    p.add_argument("run_id")
    args = p.parse_args(argv)
    from .backend import is_url, shown
    from .db import delete_run, lock_database, open_database

    try:
        if not is_url(args.db) and not Path(args.db).is_file():
            raise DashboardError(f"--db {args.db}: no such file")
        lock = lock_database(args.db)  # a running server would keep serving the deleted run
        try:
            engine = open_database(args.db)
            with engine.begin() as conn:
                pk = delete_run(conn, args.run_id)
            engine.dispose()
        finally:
            lock.close()
        if pk is None:
            raise DashboardError(f"run {args.run_id!r} not found in {shown(args.db)}")
    except DashboardError as e:
        hint = " (or delete it from the running server's page)" if "serving" in str(e) else ""
        print(f"nanotron-dashboard delete-run: error: {e}{hint}", file=sys.stderr)
        return 2
    print(f"deleted run {args.run_id} from {shown(args.db)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["delete-run"]:
        return delete_run_main(argv[1:])
    args = parse_args(argv)
    try:
        token = resolve_token(args)
        if not is_loopback(args.host) and not token:
            raise StartupConfigError(
                f"--host {args.host} is reachable from other machines: add --token-file FILE "
                f"(or {TOKEN_ENV}, or --token), or bind 127.0.0.1"
            )
        from .app import Settings, create_app

        settings = Settings(
            db=args.db,
            host=args.host,
            port=args.port,
            token=token,
            launch_token=resolve_launch_token(args),
            allow_launch=args.allow_launch,
            stall_seconds=args.stall_seconds,
            allowed_hosts=tuple(args.allowed_host),
            stall_after=args.stall_after,
            alert_webhooks=tuple(args.alert_webhook),
        )
        app = create_app(settings)
    except DashboardError as e:
        print(f"nanotron-dashboard: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .security import install_redaction

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws_max_size=4 * MAX_MESSAGE_BYTES,
        ws_max_queue=4,  # frames buffered per connection while the writer pushes back
        # no server pings: while the writer pushes back a connection is not read, so a pong
        # would go unseen and a healthy trainer be cut off; heartbeats show dead ones (stalled)
        ws_ping_interval=None,
    )
    install_redaction(app.state.redactor)  # after Config has set logging up
    login = " (token required: open it once as /?token=<your token>)" if token else ""
    if settings.allow_launch:
        login += " (to resume runs, open it once as /?token=<launch token>)"
    from .backend import shown

    print(
        f"nanotron-dashboard: serving {shown(args.db)} at {settings.public_url}/{login}", flush=True
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
