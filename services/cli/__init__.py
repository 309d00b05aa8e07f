"""The `splitmq` console command."""
