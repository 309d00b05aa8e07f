"""The live dashboard (docs/deployment.md, "The dashboard")."""
