"""The privacy policy: model, loading from the database, YAML files, the `policy` command."""
