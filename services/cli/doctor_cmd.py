"""`splitmq doctor`."""

from __future__ import annotations

import click

from services.runtime.doctor import run_checks


@click.command()
@click.pass_obj
def doctor(ctx: object) -> None:
    """Check the configured broker, store, data and torch; say what is wrong in plain words."""
    settings = ctx.settings()  # type: ignore[attr-defined]
    failed = False
    for check in run_checks(settings):
        mark = "ok  " if check.ok and not check.warning else ("warn" if check.ok else "FAIL")
        click.echo(f"[{mark}] {check.name:<7} {check.detail}")
        if check.hint:
            click.echo(f"       {' ' * 7} -> {check.hint}")
        failed |= not check.ok
    if failed:
        raise click.ClickException("some checks failed (see above)")
    click.echo("all checks passed")
