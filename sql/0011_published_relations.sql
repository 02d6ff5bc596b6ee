-- Migration 0011: published relations -- already anonymized data that suppress and dp roles read row by row.
--
-- A release made by anonproxy.create_anonymized_view (or any relation the DBA
-- vouches holds anonymized data) is *published* to some roles in mode suppress
-- or dp: apply_grants() gives each of them SELECT on it, and the proxy passes
-- their queries over it to PostgreSQL as the role itself (docs/policy.md).
--
-- What can be checked, and is, at every apply_grants(): a published relation
-- must not be, or read, a guarded (protected or linked) relation -- not a
-- guarded table or one of its partitions or children, not a view or
-- materialized view that reads one (transitively, through pg_depend), not a
-- table whose inheritance children or partitions include one, not a foreign
-- table (what it reads is not visible). What cannot be checked: the contents
-- of a plain table (CREATE TABLE ... AS SELECT * FROM a protected table is a
-- copy), and functions a view calls (PL/pgSQL records no dependencies).
-- Publishing a relation that is not a release target in anonproxy.releases
-- (when that registry exists) raises a NOTICE: the DBA vouches for it.
--
-- The same inheritance check closes a gap for every relation: a restricted role
-- that may read a parent of a guarded table reads the guarded rows through it.
--
-- This migration wraps two functions of 0002 rather than repeating them: the
-- checks of 0002 are renamed guarded_isolation_problems() and the grants
-- apply_guarded_grants(); isolation_problems() and apply_grants() keep their
-- names and signatures and call them. clear_policy() also clears the
-- published relations.

create table anonproxy.published_relations (
    relation_name text primary key,
    roles name[] not null
        constraint roles_listed check (cardinality(roles) > 0 and array_position(roles, null) is null)
);
comment on table anonproxy.published_relations is
    'Already anonymized relations (releases) that the listed roles in mode suppress or dp may read row by row.';
grant select on anonproxy.published_relations to public;

create trigger policy_changed after insert or update or delete or truncate on anonproxy.published_relations
    for each statement execute function anonproxy.policy_changed();


-- What reading a relation reveals ------------------------------------------------

-- Every relation that shows the rows of a guarded relation to whoever may SELECT
-- it: the guarded relations, the views and materialized views over them, and the
-- tables they are partitions or inheritance children of (selecting from a parent
-- reads its children with the parent's privileges), transitively. via_parent:
-- reached through an inheritance parent at least once.
create view anonproxy.exposing_relations as
with recursive exposing (relid, table_name, via_parent) as (
    select g.relid::oid, g.table_name, false from anonproxy.guarded_relations g where g.relid is not null
    union
    select next.relid, x.table_name, x.via_parent or next.parent
      from exposing x
     cross join lateral (
        select i.inhparent as relid, true as parent
          from pg_catalog.pg_inherits i where i.inhrelid = x.relid
        union all
        select rw.ev_class, false
          from pg_catalog.pg_depend d join pg_catalog.pg_rewrite rw on rw.oid = d.objid
         where d.classid = 'pg_catalog.pg_rewrite'::regclass and d.refclassid = 'pg_catalog.pg_class'::regclass
           and d.refobjid = x.relid and rw.ev_class <> x.relid
     ) next
)
select relid, table_name, via_parent from exposing;
grant select on anonproxy.exposing_relations to public;

-- The stored name of a published relation given as text (it may have been dropped since).
create function anonproxy.stored_published_name(rel text) returns text
language sql stable set search_path = pg_catalog, pg_temp as $$
    select coalesce(
        (select p.relation_name from anonproxy.published_relations p where p.relation_name = rel),
        (select format('%I.%I', n.nspname, c.relname)
           from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
          where c.oid = pg_catalog.to_regclass(rel)),
        rel)
$$;

-- What makes a published relation unfit to publish (no role in particular: role_name is null).
create function anonproxy.publication_problems()
returns table (role_name name, problem text, hint text)
language sql stable set search_path = pg_catalog, pg_temp set jit = off as $$
    with published as (
        select p.relation_name, pg_catalog.to_regclass(p.relation_name) as relid from anonproxy.published_relations p
    )
    select null::name, format('published relation %s does not exist', p.relation_name),
           format('remove it from the policy: select anonproxy.unpublish_relation(%L)', p.relation_name)
      from published p where p.relid is null
    union all
    select null::name, format('published relation %s is a foreign table; anonproxy cannot see what it reads',
                              p.relation_name),
           'publish a local table or materialized view that holds the anonymized rows'
      from published p join pg_catalog.pg_class c on c.oid = p.relid where c.relkind = 'f'
    union all
    select distinct null::name,
           case when e.relid = g.relid
                then format('published relation %s is protected data itself (%s)', p.relation_name, e.table_name)
                when e.via_parent
                then format('published relation %s includes the rows of protected table %s (a partition or '
                            'inheritance child)', p.relation_name, e.table_name)
                else format('published relation %s reads protected table %s', p.relation_name, e.table_name) end,
           'publish only anonymized data: a release made by anonproxy.create_anonymized_view, or a view over releases'
      from published p join anonproxy.exposing_relations e on e.relid = p.relid
      left join anonproxy.guarded_relations g on g.relid = e.relid
$$;

-- Relations that expose guarded rows through an inheritance parent, readable by a restricted role.
create function anonproxy.inheritance_problems()
returns table (role_name name, problem text, hint text)
language sql stable set search_path = pg_catalog, pg_temp set jit = off as $$
    with reachable as (  -- the roles each restricted role is, or may SET ROLE to
        select r.role_name, m.oid as via_oid, m.rolname as via
          from anonproxy.restricted_roles r
          join pg_catalog.pg_roles m on pg_catalog.pg_has_role(r.role_oid, m.oid, 'MEMBER')
    )
    select distinct x.role_name,
           format('role "%s" can read %s, which includes the rows of %s (a partition or inheritance child)',
                  x.role_name, e.relid::regclass, e.table_name),
           format('revoke select on %s from %I, public', e.relid::regclass, x.via)
      from reachable x join anonproxy.exposing_relations e
        on e.via_parent and pg_catalog.has_table_privilege(x.via_oid, e.relid, 'SELECT')
     where e.relid not in (select g.relid from anonproxy.guarded_relations g where g.relid is not null)
           -- a partitioned protected table is its partitions' parent; 0002 checks guarded relations
$$;

alter function anonproxy.isolation_problems() rename to guarded_isolation_problems;

-- Every way, known to us, in which a restricted role could still read a guarded
-- relation without the proxy; apply_grants() fails while this returns a row.
create function anonproxy.isolation_problems()
returns table (role_name name, problem text, hint text)
language sql stable set search_path = pg_catalog, pg_temp set jit = off as $$
    select * from anonproxy.publication_problems()
    union all
    select * from anonproxy.guarded_isolation_problems()
    union all
    select * from anonproxy.inheritance_problems()
$$;


-- Grants -------------------------------------------------------------------------

-- An error unless the caller may change the privileges of rel (GRANT by anyone else is a no-op).
create function anonproxy.check_grantor(rel regclass) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    owner regrole := (select c.relowner::regrole from pg_catalog.pg_class c where c.oid = rel);
begin
    if not pg_catalog.pg_has_role(owner::oid, 'USAGE') then
        raise exception using errcode = '42501',
            message = format('must be owner of table %s to set its privileges', rel),
            hint = format('run this as %s, its owner, or as a member of that role', owner);
    end if;
end
$$;

alter function anonproxy.apply_grants() rename to apply_guarded_grants;

-- Make PostgreSQL's privileges match the policy, then check that they do:
--   * published relations: refuse any that reads guarded rows, before granting
--     anything; then each listed role gets SELECT (and USAGE on its schema)
--     while it is in mode suppress or dp, and loses SELECT otherwise;
--   * guarded relations: as in migration 0002 (apply_guarded_grants), which
--     ends by checking isolation_problems().
create function anonproxy.apply_grants() returns void
language plpgsql set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    problem record;
    rel record;
begin
    for problem in select * from anonproxy.publication_problems() loop
        raise exception using errcode = '42501', message = problem.problem, hint = problem.hint,
            detail = 'a published relation must hold anonymized data only';
    end loop;
    for rel in
        select pg_catalog.to_regclass(p.relation_name) as relid, c.relnamespace::regnamespace as schema,
               a.rolname as role_name, coalesce(r.mode in ('suppress', 'dp'), false) as reads
          from anonproxy.published_relations p
          join pg_catalog.pg_class c on c.oid = pg_catalog.to_regclass(p.relation_name)
          cross join lateral pg_catalog.unnest(p.roles) listed (role_name)
          join pg_catalog.pg_roles a on a.rolname = listed.role_name
          left join anonproxy.role_policies r on r.role_name = listed.role_name
    loop
        perform anonproxy.check_grantor(rel.relid);
        if rel.reads then
            execute format('grant select on table %s to %I', rel.relid, rel.role_name);
            if not pg_catalog.has_schema_privilege(rel.role_name, rel.schema, 'USAGE') then
                execute format('grant usage on schema %s to %I', rel.schema, rel.role_name);
            end if;
        else
            execute format('revoke select on table %s from %I', rel.relid, rel.role_name);
        end if;
    end loop;
    perform anonproxy.apply_guarded_grants();
end
$$;

-- A role no longer listed (or a relation no longer published) loses the SELECT the policy gave it.
create function anonproxy.revoke_unpublished() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    relid regclass := pg_catalog.to_regclass(old.relation_name);
    dropped name;
begin
    if relid is null then
        return null;
    end if;
    for dropped in
        select listed.role_name from pg_catalog.unnest(old.roles) listed (role_name)
         where listed.role_name in (select a.rolname from pg_catalog.pg_roles a)
           and (tg_op = 'DELETE' or listed.role_name <> all (new.roles))
    loop
        perform anonproxy.check_grantor(relid);
        execute format('revoke select on table %s from %I', relid, dropped);
    end loop;
    return null;
end
$$;

create trigger revoke_unpublished after update or delete on anonproxy.published_relations
    for each row execute function anonproxy.revoke_unpublished();


-- Editing ---------------------------------------------------------------------------

-- Publish rel to roles (replacing the roles it was published to), then apply the grants.
create function anonproxy.publish_relation(rel regclass, roles name[]) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(rel);
    listed name;
    listed_mode text;
    release_targets regclass := pg_catalog.to_regclass('anonproxy.releases');
    is_release boolean;
begin
    if (select c.relkind from pg_catalog.pg_class c where c.oid = rel) = 'f' then
        raise exception using errcode = '42809',
            message = format('%s is a foreign table; anonproxy cannot see what it reads', target),
            hint = 'publish a local table or materialized view that holds the anonymized rows';
    end if;
    if exists (select from anonproxy.guarded_relations g where g.relid = rel) then
        raise exception using errcode = '22023',
            message = format('%s is protected data (a protected or linked table, or part of one); only anonymized '
                             'data can be published', target),
            hint = format('publish a release of it: select anonproxy.create_anonymized_view(source => %L, ...)',
                          target);
    end if;
    if roles is null or cardinality(roles) = 0 then
        raise exception using errcode = '22023', message = format('published relation %s needs at least one role',
                                                                   target),
            hint = 'list the roles in mode suppress or dp that may read it';
    end if;
    if array_position(roles, null) is not null then
        raise exception using errcode = '22004',
            message = format('the roles of published relation %s contain NULL', target);
    end if;
    if cardinality(roles) <> (select count(distinct r) from pg_catalog.unnest(roles) r) then
        raise exception using errcode = '22023',
            message = format('the roles of published relation %s list a role more than once', target);
    end if;
    foreach listed in array roles loop
        if not exists (select from pg_catalog.pg_roles a where a.rolname = listed) then
            raise exception using errcode = '42704', message = format('role "%s" does not exist', listed);
        end if;
        listed_mode := coalesce((select r.mode from anonproxy.role_policies r where r.role_name = listed), 'direct');
        if listed_mode not in ('suppress', 'dp') then
            raise exception using errcode = '22023',
                message = format('role "%s" is in mode %s; published relations are for roles in mode suppress or dp',
                                 listed, listed_mode),
                hint = case when listed_mode = 'direct'
                            then 'a direct role reads through PostgreSQL''s own grants: grant it SELECT yourself'
                            else 'a role in mode deny may read nothing' end;
        end if;
    end loop;
    if release_targets is not null then
        execute format('select exists (select from %s r where pg_catalog.to_regclass(r.target) = $1)',
                       release_targets)
            into is_release using rel;
        if not is_release then
            raise notice using message = format('%s is not a release in anonproxy.releases; publishing it vouches '
                                                'that it holds anonymized data only', target);
        end if;
    end if;
    insert into anonproxy.published_relations as p (relation_name, roles)
        values (target, roles)
        on conflict (relation_name) do update set roles = excluded.roles;
    perform anonproxy.apply_grants();
end
$$;

-- Takes text, like unprotect_table, so that a relation since dropped can still be removed.
create function anonproxy.unpublish_relation(rel text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.stored_published_name(rel);
begin
    delete from anonproxy.published_relations p where p.relation_name = target;
    if not found then
        raise exception using errcode = '42704', message = format('relation %s is not published', target),
            hint = 'give the schema-qualified name listed in anonproxy.published_relations';
    end if;
end
$$;

-- As in 0002, and the published relations too (first: their grants are taken back while the roles are listed).
create or replace function anonproxy.clear_policy() returns void
language sql set search_path = pg_catalog, pg_temp as $$
    delete from anonproxy.published_relations;
    delete from anonproxy.column_policies;
    delete from anonproxy.linked_tables;
    delete from anonproxy.protected_tables;
    delete from anonproxy.role_policies;
$$;


-- Who may call what ---------------------------------------------------------------

revoke execute on function
    anonproxy.stored_published_name(text),
    anonproxy.publication_problems(),
    anonproxy.inheritance_problems(),
    anonproxy.isolation_problems(),
    anonproxy.check_grantor(regclass),
    anonproxy.apply_grants(),
    anonproxy.revoke_unpublished(),
    anonproxy.publish_relation(regclass, name[]),
    anonproxy.unpublish_relation(text)
from public;
