"""`splitmq doctor`."""

from __future__ import annotations

import click

from services.runtime.doctor import run_checks


@click.command()
@click.pass_obj
def doctor(ctx: object) -> None:
    """Check the configured broker, store, data and torch.

    Says in plain words what is wrong and how to fix it; exits 1 if a check failed.
    """
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
