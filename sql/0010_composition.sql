-- Migration 0010: composition audit of releases (issue 6).
-- PLACEHOLDER being replaced by the composition work: check_composition
-- reports no finding until the audit lands.

create or replace function anonproxy.check_composition(release_id bigint, force boolean)
returns jsonb
language sql
as $$ select null::jsonb $$;
