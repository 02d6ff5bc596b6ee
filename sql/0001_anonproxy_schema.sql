-- Migration 0001: the anonproxy schema and its migration ledger.
--
-- Applied by `anonproxy install` (anonproxy.schema.install), which runs each
-- sql/NNNN_name.sql once, in order, in its own transaction, with
-- search_path = pg_catalog, and records it in anonproxy.schema_migrations.
-- Plain SQL on purpose: no extension and no superuser needed, so it works on
-- managed PostgreSQL. Every name is schema-qualified.

create schema if not exists anonproxy;

create table if not exists anonproxy.schema_migrations (
    version integer primary key,
    name text not null,
    applied_at timestamptz not null default now()
);
