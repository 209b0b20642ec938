"""The config and results database: models, engine, migrations."""
