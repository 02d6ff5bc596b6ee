-- Migration 0027: every release keeps the composition risk of its whole group, refreshed when the group changes.
--
-- releases.composition (0010) is the guard's finding when that release was created or refreshed: it goes stale as
-- soon as another release of the same source is created or dropped. releases.combined is the composition audit
-- (anonproxy.composition_risk, 0010) of the group a release belongs to now: every existing release of the same
-- source and sensitive column, itself included. It is what `anonproxy release list`, `verify` and `report` show.
--
--   {"releases": [...], "risk": <composition_risk summary, null when the release is alone>,
--    "max_pvp_100": <the guard's limit>, "exceeded": <PVP at 100 % above it>,
--    "unmeasured": <people of the overlap not located>, "problem": <why the risk is not fully known, or null>,
--    "measured_at": <when>}
--
-- It is written by two triggers, so that the figure comes from the same audit wherever the registry changes:
-- - when the guard records a finding (check_composition, at every creation and refresh), the finding is copied to
--   every release it combined: the attack is symmetric, so it is the same figure for each of them;
-- - when a release leaves the registry (drop_release, or a DELETE), the audit runs again on the releases left.
-- Null: not measured (the guard is off, the release has no sensitive column, or nothing was measured since).

alter table anonproxy.releases add column combined jsonb;
comment on column anonproxy.releases.combined is
    'The composition risk of this release combined with every other existing release of its source and sensitive '
    'column, as last measured (migration 0027).';

-- After the guard wrote a finding: the same measurement, for each release it combined.
create function anonproxy.release_share_finding() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    update anonproxy.releases r
       set combined = (new.composition - 'forced' - 'action') || jsonb_build_object('measured_at', now())
     where pg_catalog.to_regclass(r.target) = any (array(
               select pg_catalog.to_regclass(x) from jsonb_array_elements_text(new.composition -> 'releases') x));
    return null;
end
$$;

create trigger release_share_finding after update of composition on anonproxy.releases
for each row when (new.composition -> 'releases' is not null)
execute function anonproxy.release_share_finding();

-- After a release left the registry: the audit of the releases of its group that are left.
create function anonproxy.release_recombine() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    settings anonproxy.composition_settings;
    members regclass[];
    risk jsonb;
    problem text;
begin
    select array_agg(pg_catalog.to_regclass(g.target) order by g.id) into members
      from anonproxy.releases g
     where g.source = old.source and g.sensitive = old.sensitive and pg_catalog.to_regclass(g.target) is not null;
    if members is null then
        return null;
    end if;
    select * into settings from anonproxy.composition_settings;
    if not found then
        settings := row(true, 0, 'warn')::anonproxy.composition_settings;
    end if;
    if settings.action = 'off' then
        update anonproxy.releases r set combined = null where pg_catalog.to_regclass(r.target) = any (members);
        return null;
    end if;
    if cardinality(members) >= 2 then
        -- A drop must not fail because the audit cannot run: what stopped it is recorded instead.
        begin
            risk := anonproxy.composition_risk(members, pg_catalog.to_regclass(old.source));
        exception when others then
            get stacked diagnostics problem = message_text;
        end;
    end if;
    if (risk ->> 'unlocated')::bigint > 0 then
        problem := pg_catalog.format('%s could not be located', risk ->> 'unlocated');
    end if;
    update anonproxy.releases r
       set combined = jsonb_build_object(
               'releases', to_jsonb(members::text[]), 'risk', risk, 'max_pvp_100', settings.max_pvp_100,
               'exceeded', coalesce((risk -> 'pvp' ->> '100')::numeric, 0) > settings.max_pvp_100,
               'unmeasured', (risk ->> 'unlocated')::bigint, 'problem', problem, 'measured_at', now())
     where pg_catalog.to_regclass(r.target) = any (members);
    return null;
end
$$;

create trigger release_recombine after delete on anonproxy.releases
for each row when (old.sensitive is not null)
execute function anonproxy.release_recombine();

-- Releases made before this migration: the newest guard finding of a group, when it combined exactly the releases
-- the group has now (a later drop makes it stale: those stay null until the group changes again).
with groups as (
    select source, sensitive,
           array_agg(pg_catalog.to_regclass(target)::oid order by pg_catalog.to_regclass(target)::oid) as members
      from anonproxy.releases
     where sensitive is not null and pg_catalog.to_regclass(target) is not null
     group by source, sensitive),
latest as (
    select distinct on (source, sensitive) source, sensitive, composition, coalesce(refreshed_at, created_at) as at
      from anonproxy.releases
     where composition -> 'releases' is not null and pg_catalog.to_regclass(target) is not null
     order by source, sensitive, coalesce(refreshed_at, created_at) desc, id desc)
update anonproxy.releases r
   set combined = (l.composition - 'forced' - 'action') || jsonb_build_object('measured_at', l.at)
  from groups g join latest l using (source, sensitive)
 where r.source = g.source and r.sensitive = g.sensitive and pg_catalog.to_regclass(r.target) is not null
   and g.members = array(select pg_catalog.to_regclass(x)::oid
                           from jsonb_array_elements_text(l.composition -> 'releases') x order by 1);
