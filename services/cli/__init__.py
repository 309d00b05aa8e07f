"""The `splitmq` console command.

Every invocation, the frequent `splitmq check` healthcheck included, imports every command
module, so what pulls in torch (the roles, models, report, experiments) is imported inside the
commands that run it (`tests/unit/test_cli_imports.py` fails otherwise).
"""
