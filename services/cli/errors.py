"""The `splitmq` error boundary: a user's mistake is one line on stderr, a bug a traceback.

Every command runs inside it, so no command catches errors just to print them: a wrong URL,
a server that is down, a refused password, an unknown model (`services.common.user_errors`)
become click's one-line "Error: ..." and exit status 1; anything else keeps its traceback.
`--debug` (or SPLITMQ_DEBUG=1) shows the traceback of user errors too.
"""

from __future__ import annotations

from typing import Any

import click

from services.common.user_errors import user_message


def debug_mode(ctx: click.Context | None = None) -> bool:
    """Whether `splitmq --debug` (or SPLITMQ_DEBUG) was given."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return False
    return bool(getattr(ctx.find_root().obj, "debug", False))


class ErrorBoundary(click.Group):
    """A click group whose subcommands' user errors end as one line (`user_message`)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:  # click's own exceptions are no user_message: re-raised
            message = user_message(exc)
            if message is None or debug_mode(ctx):
                raise
            raise click.ClickException(message) from None
