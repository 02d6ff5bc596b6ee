-- Migration 0018: the migration ledger is readable by every role.
--
-- The proxy checks at start, and before each policy load, that the database has every migration the running
-- anonproxy ships (anonproxy/schema.py, missing_versions); it does so as its service login, which owns nothing.
-- The ledger holds version numbers, names and dates: nothing to hide.

grant select on anonproxy.schema_migrations to public;
