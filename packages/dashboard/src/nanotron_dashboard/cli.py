"""`nanotron-dashboard --db runs.db --host 127.0.0.1 --port 8008 [--token T] [--allow-launch]`."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from .errors import DashboardError, StartupConfigError
from .messages import MAX_MESSAGE_BYTES


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanotron-dashboard", description=__doc__)
    p.add_argument("--db", default="runs.db", help="SQLite file (created if missing)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8008)
    p.add_argument("--token", default=None, help="required for a non-loopback --host")
    p.add_argument("--allow-launch", action="store_true", help="enable the Resume button")
    p.add_argument("--stall-seconds", type=float, default=120.0, help="heartbeat age => stalled")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not is_loopback(args.host) and not args.token:
            raise StartupConfigError(
                f"--host {args.host} is reachable from other machines: add --token SECRET "
                "(or bind 127.0.0.1)"
            )
        from .app import Settings, create_app

        settings = Settings(
            db=args.db,
            host=args.host,
            port=args.port,
            token=args.token,
            allow_launch=args.allow_launch,
            stall_seconds=args.stall_seconds,
        )
        app = create_app(settings)
    except DashboardError as e:
        print(f"nanotron-dashboard: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    url = settings.public_url + (f"/?token={args.token}" if args.token else "/")
    print(f"nanotron-dashboard: serving {args.db} at {url}", flush=True)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ws_max_size=4 * MAX_MESSAGE_BYTES,
        ws_ping_interval=20,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
