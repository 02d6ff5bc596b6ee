"""In-database anonymized views (issue 5): hierarchies, releases and their CLI.

The anonymization itself runs inside PostgreSQL (sql/0004–0010); this package
loads hierarchy files, and drives ``anonproxy.create_anonymized_view`` from the
command line. docs/views.md is the user guide, docs/views-internals.md the
contracts between the SQL pieces.
"""
