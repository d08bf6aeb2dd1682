"""``celery -A proj pglock web``: the dashboard, served by waitress (extra ``web``)."""

from __future__ import annotations

import click

from celery_pglock._config import web_credentials
from celery_pglock.cli._common import Refused, current_app, reported_errors


def _bind(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8555)")
    return host.strip("[]"), int(port)


@click.command()
@click.option(
    "--bind",
    default="127.0.0.1:8555",
    show_default=True,
    callback=_bind,
    help="HOST:PORT to listen on; the default, loopback, is reachable from this machine only.",
)
@click.pass_context
def web(ctx: click.Context, bind: tuple[str, int]) -> None:
    """Serve the web dashboard: entries, slots, locks, audit; actions with credentials."""
    app = current_app(ctx)
    try:
        from celery_pglock.web import serve  # noqa: PLC0415 - the extra, when used
    except ImportError as exc:
        raise Refused(
            f'the dashboard needs the extra: pip install "celery-pglock[web]" ({exc})'
        ) from None
    with reported_errors():
        credentials = web_credentials(app.conf)
    host, port = bind
    where = (
        "loopback only: this machine"
        if host in ("127.0.0.1", "::1", "localhost")
        else ("NOT loopback: reachable from the network")
    )
    acting = "actions need credentials" if credentials else "read-only (no credentials configured)"
    click.echo(f"celery-pglock dashboard on http://{host}:{port}/ ({where}; {acting})", err=True)
    serve(app, host, port)
