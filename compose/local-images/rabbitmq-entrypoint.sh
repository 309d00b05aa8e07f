#!/bin/sh
# As the official image does: the account from RABBITMQ_DEFAULT_USER / RABBITMQ_DEFAULT_PASS
# (created on the first start of an empty data directory), logs to the console.
set -eu
conf=/etc/rabbitmq/conf.d/05-default-user.conf
: > "$conf"
if [ -n "${RABBITMQ_DEFAULT_USER:-}" ]; then
    printf 'default_user = %s\ndefault_pass = %s\n' \
        "$RABBITMQ_DEFAULT_USER" "${RABBITMQ_DEFAULT_PASS:-}" >> "$conf"
fi
printf 'log.console = true\nlog.file = false\n' >> "$conf"
exec "$@"
