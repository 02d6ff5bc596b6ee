-- Migration 0005: anonymized releases (issue 5): the registry, create_anonymized_view,
-- refresh_anonymized_view and drop_release.
--
-- create_anonymized_view checks every argument (each mistake is an error with
-- a SQLSTATE, a message naming it and a hint), copies the source into the temp
-- table pg_temp.anonproxy_input, calls the method function
-- anonproxy.anonymize_<method>(input, spec) (migrations 0006-0008), builds the
-- target table from its output, measures it with the verification functions of
-- 0009 (which share no code with the methods) and refuses a result that misses
-- the asked levels, records it in anonproxy.releases and asks
-- anonproxy.check_composition (0010) about it. All of it happens in the
-- caller's transaction, so an error leaves nothing behind.
-- docs/views-internals.md states the contracts; docs/views.md is the user guide.
--
-- Every function runs with search_path = pg_catalog, pg_temp, so that no object
-- another role creates in a schema on the caller's path (a public.format(text,
-- text), say) can take over a call made with the caller's rights. The three
-- entry points are the exception: an unqualified target name goes into the
-- caller's current schema, as CREATE TABLE would put it, so they keep the
-- caller's path; each is one call of schema-qualified functions, with no
-- operator, that passes pg_catalog.current_schema() along.

create table anonproxy.releases (
    id bigint generated always as identity primary key,
    source text not null,
    target text not null unique,
    method text not null
        constraint release_method
        check (method in ('mondrian', 'mondrian_relaxed', 'full_domain', 'mdav', 'tclose_first')),
    quasi_identifiers text[] not null,
    sensitive text,
    unit text,
    parameters jsonb not null,
    method_facts jsonb not null,
    achieved jsonb not null,
    metrics jsonb not null,
    composition jsonb,
    forced boolean not null default false,
    created_by text not null default current_user,
    created_at timestamptz not null default now(),
    refreshed_at timestamptz
);
comment on table anonproxy.releases is
    'Anonymized tables made by anonproxy.create_anonymized_view: how they were made and what they achieve.';
-- No grant to PUBLIC: the registry holds exact row counts and measurements of
-- the source. Readers need an explicit grant (docs/views.md, "Rights").

-- What create_anonymized_view and refresh_anonymized_view return.
create type anonproxy.release_summary as (
    release_id bigint,
    target text,
    method text,
    k bigint,                   -- smallest equivalence class, in privacy units
    l numeric,                  -- with a sensitive column: entropy l (l_kind entropy), else distinct l
    c numeric,                  -- recursive (c,l): the table holds for every c above this one
    t numeric,                  -- with a sensitive column: largest EMD of a class (the asked distance)
    equivalence_classes bigint,
    suppressed_rows bigint,
    ncp numeric,                -- normalized certainty penalty, 0 (nothing generalized) .. 1
    sse_sst numeric,            -- microaggregation: within-class share of the numeric QIs' variance
    elapsed interval
);


-- Names ------------------------------------------------------------------------

-- The registry name 'schema.table' of a target given as SQL text ('t', 's.t',
-- '"My T"'); an unqualified name is in schema schema_name (the caller's current one).
create function anonproxy.release_target_name(target text, schema_name text) returns text
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
declare
    parts text[];
begin
    if target is null or target = '' then
        raise exception using errcode = '22004', message = 'target must not be null or empty';
    end if;
    begin
        parts := pg_catalog.parse_ident(target);
    exception when invalid_parameter_value then
        raise exception using errcode = '42602',
            message = pg_catalog.format('target %s is not a valid table name', target),
            hint = pg_catalog.format('quote a name with spaces or capitals: %s',
                                     pg_catalog.quote_literal(pg_catalog.quote_ident(target)));
    end;
    if pg_catalog.cardinality(parts) = 1 then
        if schema_name is null then
            raise exception using errcode = '3F000', message = pg_catalog.format('no schema to create %s in', target),
                hint = 'qualify the target with a schema: schema.table';
        end if;
        parts := pg_catalog.array_prepend(schema_name, parts);
    elsif pg_catalog.cardinality(parts) <> 2 then
        raise exception using errcode = '42602',
            message = pg_catalog.format('target %s is not a schema.table name', target);
    end if;
    return pg_catalog.format('%I.%I', parts[1], parts[2]);
end
$$;

-- Refuse a new release's target (a registry name) that cannot or must not be created.
create function anonproxy.release_check_target(target_name text) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    schema_name text := (parse_ident(target_name))[1];
    unreadable text;
begin
    if schema_name in ('pg_catalog', 'information_schema') or schema_name like 'pg\_%' then
        raise exception using errcode = '22023',
            message = format('target %s is in a system or temporary schema', target_name),
            hint = 'a release is a lasting table: put it in an ordinary schema';
    end if;
    if not exists (select from pg_catalog.pg_namespace n where n.nspname = schema_name) then
        raise exception using errcode = '3F000',
            message = format('schema %s of target %s does not exist', quote_ident(schema_name), target_name);
    end if;
    -- Fail before the work rather than after it.
    if not has_schema_privilege(schema_name, 'CREATE') then
        raise exception using errcode = '42501',
            message = format('permission denied to create %s: no CREATE privilege on schema %s', target_name,
                             quote_ident(schema_name)),
            hint = format('grant create on schema %s to %s', quote_ident(schema_name), quote_ident(current_user));
    end if;
    if not has_database_privilege(current_database(), 'TEMPORARY') then
        raise exception using errcode = '42501',
            message = format('permission denied to stage the source: no TEMPORARY privilege on database %s',
                             quote_ident(current_database())),
            hint = format('grant temporary on database %s to %s', quote_ident(current_database()),
                          quote_ident(current_user));
    end if;
    if not has_table_privilege('anonproxy.releases', 'INSERT') then
        raise exception using errcode = '42501',
            message = 'permission denied to record a release: no INSERT privilege on anonproxy.releases',
            hint = format('grant select, insert, update, delete on anonproxy.releases to %s', quote_ident(current_user));
    end if;
    select t into unreadable from unnest(array['anonproxy.releases', 'anonproxy.hierarchies',
                                               'anonproxy.hierarchy_nodes']) t
     where not has_table_privilege(t, 'SELECT') limit 1;
    if found then
        raise exception using errcode = '42501',
            message = format('permission denied to make a release: no SELECT privilege on %s', unreadable),
            hint = format('grant select on %s to %s', unreadable, quote_ident(current_user));
    end if;
    if to_regclass(target_name) is not null then
        raise exception using errcode = '42P07', message = format('relation %s already exists', target_name),
            hint = 'choose another target; to rebuild a release use anonproxy.refresh_anonymized_view';
    end if;
    if exists (select from anonproxy.releases r where r.target = target_name) then
        raise exception using errcode = '42710',
            message = format('release %s is registered, though its table is gone', target_name),
            hint = format('forget it first: select anonproxy.drop_release(%L)', target_name);
    end if;
end
$$;

-- The registry row of a release (its registry name), locked, or an error.
create function anonproxy.release_of(target text) returns anonproxy.releases
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    found_release anonproxy.releases;
begin
    select r.* into found_release from anonproxy.releases r where r.target = release_of.target for update;
    if not found then
        raise exception using errcode = '42704', message = pg_catalog.format('%s is not an anonymized release', target),
            hint = 'anonproxy.releases lists the releases';
    end if;
    return found_release;
end
$$;


-- Arguments --------------------------------------------------------------------

-- A column of rel, or an error 42703 naming it and listing the columns.
create function anonproxy.release_column(rel regclass, column_name text, role text) returns pg_catalog.pg_attribute
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    found_column pg_catalog.pg_attribute;
begin
    select a.* into found_column from pg_catalog.pg_attribute a
     where a.attrelid = rel and a.attname = column_name and a.attnum > 0 and not a.attisdropped;
    if not found then
        raise exception using errcode = '42703',
            message = format('%s column %s does not exist in %s', role, quote_ident(column_name), rel),
            hint = format('columns of %s: %s', rel,
                          (select string_agg(quote_ident(a.attname), ', ' order by a.attnum)
                             from pg_catalog.pg_attribute a
                            where a.attrelid = rel and a.attnum > 0 and not a.attisdropped));
    end if;
    -- The staging and scratch tables of the methods name their own columns _row, _unit, _cluster, ….
    if column_name like '\_%' then
        raise exception using errcode = '42939',
            message = format('column name %s is reserved: names starting with _ are the methods'' own columns',
                             quote_ident(column_name)),
            hint = format('anonymize a view over %s that renames it', rel);
    end if;
    return found_column;
end
$$;

-- 'numeric' for the number types (they are staged as numeric), else 'categorical'
-- (staged as text). A number type is one of the numeric category, on the base type
-- of a domain, that converts to numeric: not money (its text is '$1.00'), not oid
-- or the reg* types.
create function anonproxy.release_column_kind(type_oid oid) returns text
language sql stable set search_path = pg_catalog, pg_temp as $$
    select case when b.typcategory = 'N' and b.oid <> 'money'::regtype
                     and (b.oid = 'numeric'::regtype
                          or exists (select from pg_catalog.pg_cast c
                                      where c.castsource = b.oid and c.casttarget = 'numeric'::regtype))
                then 'numeric' else 'categorical' end
      from pg_catalog.pg_type t join pg_catalog.pg_type b on b.oid = coalesce(nullif(t.typbasetype, 0), t.oid)
     where t.oid = type_oid
$$;

-- The hierarchy a column uses: the one named in `chosen` (a JSON null: none),
-- else the one named '<table>.<column>' if it exists, else none.
create function anonproxy.release_hierarchy(source regclass, column_name text, chosen jsonb) returns text
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    chosen_name text;
begin
    if chosen ? column_name then
        if jsonb_typeof(chosen -> column_name) not in ('string', 'null') then
            raise exception using errcode = '22023',
                message = format('hierarchies: the value for %s must be a hierarchy name or null, not %s',
                                 column_name, chosen -> column_name);
        end if;
        chosen_name := chosen ->> column_name;
        if chosen_name is not null and not exists (select from anonproxy.hierarchies h where h.name = chosen_name) then
            raise exception using errcode = '42704',
                message = format('hierarchy %L, named for column %s, does not exist', chosen_name, column_name),
                hint = 'anonproxy.hierarchies lists the hierarchies; `anonproxy hierarchy load` adds one';
        end if;
        return chosen_name;
    end if;
    select h.name into chosen_name from anonproxy.hierarchies h
     where h.name = (select c.relname from pg_catalog.pg_class c where c.oid = source) || '.' || column_name;
    return chosen_name;
end
$$;

-- Check every argument that can be checked without reading the data; return the
-- spec the method receives (docs/views-internals.md).
create function anonproxy.release_spec(
    source regclass, quasi_identifiers text[], sensitive text, k integer, l numeric, l_kind text, c numeric,
    t numeric, t_distance text, method text, suppression_limit numeric, unit text, hierarchies jsonb
) returns jsonb
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    methods constant text[] := array['mondrian', 'mondrian_relaxed', 'full_domain', 'mdav', 'tclose_first'];
    relkind "char";
    qi_specs jsonb := '[]';
    qi text;
    col pg_catalog.pg_attribute;
    sensitive_spec jsonb;
    key text;
begin
    if source is null then
        raise exception using errcode = '22004', message = 'source must not be null';
    end if;
    select cl.relkind into relkind from pg_catalog.pg_class cl where cl.oid = source;
    if relkind not in ('r', 'p', 'v', 'm', 'f') then
        raise exception using errcode = '42809', message = format('source %s is not a table or view', source);
    end if;
    if method is null or not method = any (methods) then
        raise exception using errcode = '22023',
            message = format('unknown method %s', coalesce(quote_literal(method), 'null')),
            hint = format('methods: %s', array_to_string(methods, ', '));
    end if;

    if quasi_identifiers is null or cardinality(quasi_identifiers) = 0 then
        raise exception using errcode = '22023', message = 'quasi_identifiers must name at least one column',
            hint = 'for example quasi_identifiers => ARRAY[''age'', ''sex'']';
    end if;
    if array_ndims(quasi_identifiers) <> 1 or array_position(quasi_identifiers, null) is not null then
        raise exception using errcode = '22004', message = 'quasi_identifiers must be a list of column names without nulls';
    end if;
    select q into qi from unnest(quasi_identifiers) q group by q having count(*) > 1 limit 1;
    if found then
        raise exception using errcode = '42701', message = format('quasi-identifier %s is named twice', quote_ident(qi));
    end if;
    if hierarchies is not null and jsonb_typeof(hierarchies) <> 'object' then
        raise exception using errcode = '22023', message = 'hierarchies must be a JSON object of column -> hierarchy name',
            hint = 'for example hierarchies => ''{"education": "adult.education"}''';
    end if;
    foreach qi in array quasi_identifiers loop
        col := anonproxy.release_column(source, qi, 'quasi-identifier');
        qi_specs := qi_specs || jsonb_build_object('name', qi, 'kind', anonproxy.release_column_kind(col.atttypid),
                                                   'hierarchy', anonproxy.release_hierarchy(source, qi, hierarchies));
    end loop;

    if sensitive is not null then
        col := anonproxy.release_column(source, sensitive, 'sensitive');
        if sensitive = any (quasi_identifiers) then
            raise exception using errcode = '22023',
                message = format('column %s is both a quasi-identifier and the sensitive column', quote_ident(sensitive)),
                hint = 'a release generalizes its quasi-identifiers and keeps the sensitive column as it is: '
                       'choose one role';
        end if;
        sensitive_spec := jsonb_build_object('name', sensitive, 'kind', anonproxy.release_column_kind(col.atttypid),
                                             'hierarchy', anonproxy.release_hierarchy(source, sensitive, hierarchies));
    end if;
    if unit is not null then
        perform anonproxy.release_column(source, unit, 'privacy-unit');
        if unit = any (quasi_identifiers) or unit is not distinct from sensitive then
            raise exception using errcode = '22023',
                message = format('the privacy-unit column %s cannot also be a quasi-identifier or the sensitive column',
                                 quote_ident(unit)),
                hint = 'the unit identifies the person and is left out of the release';
        end if;
    end if;
    for key in select jsonb_object_keys(hierarchies) loop
        if not (key = any (quasi_identifiers) or key is not distinct from sensitive) then
            raise exception using errcode = '22023',
                message = format('hierarchies names column %s, which is neither a quasi-identifier '
                                 'nor the sensitive column',
                                 quote_ident(key));
        end if;
    end loop;

    if k is null then
        raise exception using errcode = '22004', message = 'k is required',
            hint = 'every release is k-anonymous: pass k => 2 or more';
    end if;
    if k < 2 then
        raise exception using errcode = '22023', message = format('k must be at least 2, not %s', k),
            hint = 'k = 1 would publish every row as it is';
    end if;

    key := (select x.name from (values ('l', l), ('c', c), ('t', t)) x(name, value)
             where x.value in ('NaN', 'Infinity', '-Infinity') limit 1);
    if key is not null then
        raise exception using errcode = '22023',
            message = format('%s must be a finite number, not %s', key, case key when 'l' then l when 'c' then c else t end),
            hint = 'NaN and Infinity are no privacy level: pass a number';
    end if;
    if l_kind is null or l_kind not in ('distinct', 'entropy', 'recursive') then
        raise exception using errcode = '22023',
            message = format('unknown l_kind %s', coalesce(quote_literal(l_kind), 'null')),
            hint = 'l_kind is distinct, entropy or recursive';
    end if;
    if l is not null then
        if sensitive is null then
            raise exception using errcode = '22023', message = 'l-diversity needs a sensitive column',
                hint = 'name it: sensitive => ''occupation''';
        end if;
        if l <= 1 then
            raise exception using errcode = '22023', message = format('l must be greater than 1, not %s', l),
                hint = 'omit l for no l-diversity requirement';
        end if;
        if l_kind in ('distinct', 'recursive') and l <> trunc(l) then
            raise exception using errcode = '22023',
                message = format('%s l-diversity needs a whole number l, not %s', l_kind, l);
        end if;
        if l_kind in ('distinct', 'recursive') and l > 2147483647 then
            raise exception using errcode = '22023',
                message = format('%s l-diversity needs l of at most 2147483647, not %s', l_kind, l),
                hint = 'l counts distinct sensitive values';
        end if;
        if l_kind = 'recursive' and (c is null or c <= 0) then
            raise exception using errcode = '22023',
                message = format('recursive (c,l)-diversity needs c > 0, not %s', coalesce(c::text, 'null'));
        end if;
    end if;
    if c is not null and (l is null or l_kind <> 'recursive') then
        raise exception using errcode = '22023', message = 'c applies only to recursive (c,l)-diversity',
            hint = 'pass l => …, l_kind => ''recursive'' with it, or omit c';
    end if;

    -- No distance named: ordered for a numeric sensitive column, equal for any other.
    t_distance := coalesce(t_distance, case sensitive_spec ->> 'kind' when 'numeric' then 'ordered' else 'equal' end);
    if t_distance not in ('ordered', 'equal', 'hierarchical') then
        raise exception using errcode = '22023',
            message = format('unknown t_distance %s', quote_literal(t_distance)),
            hint = 't_distance is ordered (numbers), equal (categories) or hierarchical (categories with a hierarchy)';
    end if;
    if t is not null then
        if t <= 0 or t > 1 then
            raise exception using errcode = '22023', message = format('t must be in (0, 1], not %s', t);
        end if;
        if sensitive is null then
            raise exception using errcode = '22023', message = 't-closeness needs a sensitive column',
                hint = 'name it: sensitive => ''occupation''';
        end if;
        if t_distance = 'ordered' and sensitive_spec ->> 'kind' <> 'numeric' then
            raise exception using errcode = '22023',
                message = format('the ordered distance needs a numeric sensitive column; %s is not numeric',
                                 quote_ident(sensitive)),
                hint = 'use t_distance => ''equal'', or ''hierarchical'' with a hierarchy for it';
        end if;
        if t_distance = 'hierarchical' and sensitive_spec ->> 'hierarchy' is null then
            raise exception using errcode = '42704',
                message = format('the hierarchical distance needs a hierarchy for the sensitive column %s',
                                 quote_ident(sensitive)),
                hint = format('name one: hierarchies => %L', jsonb_build_object(sensitive, '…'));
        end if;
    end if;

    if suppression_limit is null or suppression_limit < 0 or suppression_limit >= 1 then
        raise exception using errcode = '22023',
            message = format('suppression_limit must be in [0, 1), not %s', coalesce(suppression_limit::text, 'null')),
            hint = 'it is the largest share of rows a method may leave out';
    end if;

    if method = 'full_domain' then
        select q ->> 'name' into qi from jsonb_array_elements(qi_specs) q where q ->> 'hierarchy' is null limit 1;
        if found then
            raise exception using errcode = '42704',
                message = format('full_domain needs a hierarchy for every quasi-identifier; %s has none', quote_ident(qi)),
                hint = format('load or build one (anonproxy hierarchy load|build-intervals|build-prefix) and name it: '
                              'hierarchies => %L', jsonb_build_object(qi, '…'));
        end if;
    end if;
    if method = 'tclose_first' and t is null then
        raise exception using errcode = '22023', message = 'tclose_first needs t',
            hint = 'pass t => 0.2 (and sensitive => …), or use method => ''mdav''';
    end if;

    return jsonb_build_object(
        'qi', qi_specs, 'sensitive', sensitive_spec, 'k', k, 'l', l, 'l_kind', l_kind, 'c', c,
        't', t, 't_distance', t_distance, 'suppression_limit', suppression_limit,
        'variant', case when method = 'mondrian_relaxed' then 'relaxed' else 'strict' end,
        'output', 'anonproxy_output');
end
$$;


-- Staging and running a method -------------------------------------------------

create function anonproxy.release_progress(done integer, total integer, phase text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise notice 'anonproxy progress % of %: %', done, total, phase;
end
$$;

-- Copy the source into pg_temp.anonproxy_input and check what needs the data.
-- ANALYZE samples 3,000 rows instead of 30,000: enough for the row counts and
-- rough distinct counts the methods' plans need, and on adult it took ~30 ms
-- instead of ~300 ms (shared development machine).
create function anonproxy.release_stage(source regclass, spec jsonb, unit text) returns void
language plpgsql set search_path = pg_catalog, pg_temp set default_statistics_target = 10 as $$
declare
    columns jsonb := spec -> 'qi' || case when jsonb_typeof(spec -> 'sensitive') = 'object'
                                          then jsonb_build_array(spec -> 'sensitive') else '[]' end;
    sensitive text := spec -> 'sensitive' ->> 'name';
    staged_columns text;
    source_values text;
    inner_values text;
    item record;
    how_many bigint;
    null_column text;
    checked_columns text;
    checked_values text;
    whole_table numeric;
begin
    if to_regclass('pg_temp.anonproxy_input') is not null or to_regclass('pg_temp.anonproxy_output') is not null
       or to_regclass('pg_temp.anonproxy_measured') is not null then
        raise exception using errcode = '42P07',
            message = 'temporary table anonproxy_input, anonproxy_output or anonproxy_measured already exists '
                      'in this session',
            hint = 'they are the staging tables of create_anonymized_view: drop them, or use another session';
    end if;
    -- Inner aliases r, u, c1, c2, … cannot clash with the source's column names.
    select string_agg(format('%I %s not null', c.value ->> 'name', t.type), ', ' order by c.ordinality),
           string_agg(format('%I::%s as c%s', c.value ->> 'name', t.type, c.ordinality), ', ' order by c.ordinality),
           string_agg(format('s.c%s', c.ordinality), ', ' order by c.ordinality)
      into staged_columns, source_values, inner_values
      from jsonb_array_elements(columns) with ordinality c,
           lateral (select case c.value ->> 'kind' when 'numeric' then 'numeric' else 'text' end as type) t;
    execute format('create temp table anonproxy_input (_row bigint not null, _unit text not null, %s) '
                   'on commit drop', staged_columns);
    -- The NOT NULL constraints find a NULL without a scan of their own.
    begin
        execute format('insert into pg_temp.anonproxy_input select s.r, %s, %s '
                       'from (select row_number() over () as r, %s as u, %s from %s) s',
                       case when unit is null then 's.r::text' else 's.u' end, inner_values,
                       case when unit is null then 'null::text' else format('%I::text', unit) end,
                       source_values, source);
    exception when not_null_violation then
        get stacked diagnostics null_column = column_name;
        null_column := case null_column when '_unit' then unit else null_column end;
        execute format('select count(*) from %s where %I is null', source, null_column) into how_many;
        raise exception using errcode = '22004',
            message = format('%s column %s of %s has %s NULL value(s)',
                             case null_column when unit then 'privacy-unit' when sensitive then 'sensitive'
                                  else 'quasi-identifier' end, quote_ident(null_column), source, how_many),
            hint = case null_column when unit then 'every row must belong to a person'
                        else 'anonymize a view of the source that leaves them out or replaces them' end;
    end;
    -- NaN and ±Infinity have no place on a number line the methods can cut or average.
    select string_agg(format('(%L, i.%I)', c ->> 'name', c ->> 'name'), ', ') into checked_values
      from jsonb_array_elements(columns) c where c ->> 'kind' = 'numeric';
    if checked_values is not null then
        execute format('select v.name from pg_temp.anonproxy_input i, lateral (values %s) v(name, value) '
                       'where v.value in (''NaN'', ''Infinity'', ''-Infinity'') limit 1', checked_values)
           into null_column;
        if null_column is not null then
            raise exception using errcode = '22023',
                message = format('column %s of %s has NaN or infinite values', quote_ident(null_column), source),
                hint = 'anonymize a view of the source that leaves them out or replaces them';
        end if;
    end if;
    -- Indexing after the insert is cheaper than maintaining the index row by row.
    alter table pg_temp.anonproxy_input add primary key (_row);
    analyze pg_temp.anonproxy_input;

    if unit is null then
        select count(*) into how_many from pg_temp.anonproxy_input;
    else
        select count(distinct i._unit) into how_many from pg_temp.anonproxy_input i;
    end if;
    if (spec ->> 'k')::bigint > how_many then
        raise exception using errcode = '22023',
            message = format('k = %s exceeds the %s %s of %s', spec ->> 'k', how_many,
                             case when unit is null then 'rows' else 'privacy units' end, source),
            hint = 'no k-anonymous release of it exists: lower k';
    end if;

    -- Values missing from their column's hierarchy. One scan: a grouping set per
    -- column gives its distinct values (the other columns are NULL in that group).
    select string_agg(format('%I', c ->> 'name'), ', '),
           string_agg(format('(%L, %L, g.%I::text)', c ->> 'name', c ->> 'hierarchy', c ->> 'name'), ', ')
      into checked_columns, checked_values
      from jsonb_array_elements(columns) c where c ->> 'hierarchy' is not null;
    if checked_columns is not null then
        execute format('select v.name, string_agg(quote_literal(v.value), '', '' order by v.value) '
                       'from (select %1$s from pg_temp.anonproxy_input group by grouping sets (%1$s)) g, '
                       'lateral (values %2$s) v(name, hierarchy, value) '
                       'where v.value is not null and not exists (select from anonproxy.hierarchy_nodes n '
                       'where n.hierarchy = v.hierarchy and n.level = 0 and n.leaf = v.value) '
                       'group by v.name limit 1', checked_columns, checked_values) into item;
        if item.name is not null then
            raise exception using errcode = '22023',
                message = format('values of column %s are missing from hierarchy %L: %s', quote_ident(item.name),
                                 (select c ->> 'hierarchy' from jsonb_array_elements(columns) c
                                   where c ->> 'name' = item.name), left(item.string_agg, 200)),
                hint = format('add them to the hierarchy, or name another one: hierarchies => %L',
                              jsonb_build_object(item.name, '…'));
        end if;
    end if;

    -- An l the whole table misses, no partition reaches: each kind is monotone
    -- (classes that are diverse merge into a diverse class). Suppressing rows
    -- could drop the values that spoil it, so only without suppression.
    if spec ->> 'l' is not null and (spec ->> 'suppression_limit')::numeric = 0 then
        execute format('create temp view anonproxy_whole_table as '
                       'select distinct 1 as _whole_table, i._unit, i.%I from pg_temp.anonproxy_input i', sensitive);
        whole_table := anonproxy.l_diversity('pg_temp.anonproxy_whole_table', array['_whole_table'], sensitive,
                                             spec ->> 'l_kind', case when spec ->> 'l_kind' = 'recursive'
                                                                     then (spec ->> 'l')::integer end);
        drop view pg_temp.anonproxy_whole_table;
        if spec ->> 'l_kind' = 'recursive' and whole_table >= (spec ->> 'c')::numeric then
            raise exception using errcode = '22023',
                message = format('no release can be recursive (%s,%s)-diverse: the whole table is so only for c above %s',
                                 spec ->> 'c', spec ->> 'l', trim_scale(round(whole_table, 4))),
                hint = 'raise c, lower l, or choose another sensitive column';
        elsif spec ->> 'l_kind' <> 'recursive' and whole_table < (spec ->> 'l')::numeric then
            raise exception using errcode = '22023',
                message = format('no release can be %1$s l-diverse with l = %2$s: the whole table has %1$s l = %3$s',
                                 spec ->> 'l_kind', spec ->> 'l', trim_scale(round(whole_table, 4))),
                hint = 'lower l, or choose another sensitive column';
        end if;
    end if;
end
$$;

-- Call the method on the staged input; check that its output is one row per
-- kept input row with every quasi-identifier. Returns the method's facts.
create function anonproxy.release_run(method text, spec jsonb) returns jsonb
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    function_name text := 'anonymize_' || case method when 'mondrian_relaxed' then 'mondrian' else method end;
    facts jsonb;
    missing text;
    output_rows bigint;
    distinct_rows bigint;
    matched_rows bigint;
begin
    if to_regprocedure(format('anonproxy.%I(regclass, jsonb)', function_name)) is null then
        raise exception using errcode = '0A000',
            message = format('method %s is not installed: anonproxy.%s(regclass, jsonb) does not exist',
                             method, function_name),
            hint = 'upgrade the schema: anonproxy install --dsn …';
    end if;
    execute format('select anonproxy.%I($1, $2)', function_name)
       into facts using 'pg_temp.anonproxy_input'::regclass, spec;

    if to_regclass('pg_temp.anonproxy_output') is null then
        raise exception using errcode = 'XX000', message = format('method %s did not create its output table', method);
    end if;
    select string_agg(needed.name, ', ') into missing
      from (select q ->> 'name' as name from jsonb_array_elements(spec -> 'qi') q union all select '_row') needed
     where not exists (select from pg_catalog.pg_attribute a
                        where a.attrelid = 'pg_temp.anonproxy_output'::regclass and a.attname = needed.name
                          and a.attnum > 0 and not a.attisdropped);
    if missing is not null then
        raise exception using errcode = 'XX000',
            message = format('the output of method %s lacks column(s) %s', method, missing);
    end if;
    select count(*), count(distinct o._row), count(i._row) into output_rows, distinct_rows, matched_rows
      from pg_temp.anonproxy_output o left join pg_temp.anonproxy_input i on i._row = o._row;
    if output_rows <> distinct_rows or output_rows <> matched_rows then
        raise exception using errcode = 'XX000',
            message = format('the output of method %s is not one row per kept input row', method);
    end if;
    return coalesce(facts, '{}');
end
$$;

-- The column list of a release: quasi-identifiers in order, then the sensitive column.
create function anonproxy.release_columns(spec jsonb) returns text
language sql immutable set search_path = pg_catalog, pg_temp as $$
    select string_agg(format('%I', c.name), ', ' order by c.position)
      from (select q.value ->> 'name' as name, q.ordinality as position
              from jsonb_array_elements(spec -> 'qi') with ordinality q
            union all
            select spec -> 'sensitive' ->> 'name', 1e9 where jsonb_typeof(spec -> 'sensitive') = 'object') c
$$;

-- The SELECT giving the release's rows: the quasi-identifiers as the method
-- wrote them, the sensitive column cast back to its type in the source; sorted,
-- so that row order tells nothing about the source's row order.
create function anonproxy.release_rows(source regclass, spec jsonb) returns text
language sql stable set search_path = pg_catalog, pg_temp as $$
    select format('select %s from pg_temp.anonproxy_output o join pg_temp.anonproxy_input i on i._row = o._row '
                  'order by %s',
                  concat_ws(', ', qi.list, case when s.name is not null
                                                then format('i.%1$I::%2$s as %1$I', s.name, s.type) end),
                  -- The sensitive column by its staged value (text or numeric): its own type
                  -- (json, point, …) may have no ordering.
                  concat_ws(', ', (select string_agg(p::text, ', ') from generate_series(1, qi.n) p),
                            case when s.name is not null then format('i.%I', s.name) end))
      from (select string_agg(format('o.%I', q ->> 'name'), ', ' order by o) as list, count(*) as n
              from jsonb_array_elements(spec -> 'qi') with ordinality x(q, o)) qi
      left join (select a.attname::text as name, format_type(a.atttypid, a.atttypmod) as type
                   from pg_catalog.pg_attribute a
                  where a.attrelid = source and a.attname = spec -> 'sensitive' ->> 'name'
                    and a.attnum > 0 and not a.attisdropped) s on true
$$;

-- Measure a release with the verification functions of 0009 and refuse it when
-- it misses what was asked. With a privacy unit, k, l and t count each unit once
-- per class and sensitive value: they are measured on the distinct (class,
-- sensitive value, unit) triples; without one, on the release's rows.
-- Returns {"achieved": …, "metrics": anonproxy.utility(…)}.
create function anonproxy.release_measure(target regclass, method text, spec jsonb, unit text) returns jsonb
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    qi text[] := array(select q ->> 'name' from jsonb_array_elements(spec -> 'qi') q);
    sensitive text := spec -> 'sensitive' ->> 'name';
    distance text := case when spec ->> 't' is not null then spec ->> 't_distance'
                          when spec -> 'sensitive' ->> 'kind' = 'numeric' then 'ordered' else 'equal' end;
    measured regclass := target;
    achieved jsonb;
    metrics jsonb;
    failed text;
begin
    if unit is not null then
        execute format('create temp table anonproxy_measured on commit drop as select distinct %s, i._unit '
                       'from pg_temp.anonproxy_output o join pg_temp.anonproxy_input i on i._row = o._row',
                       concat_ws(', ', (select string_agg(format('o.%I', c), ', ') from unnest(qi) c),
                                 case when sensitive is not null then format('i.%I', sensitive) end));
        measured := 'pg_temp.anonproxy_measured';
    end if;
    achieved := jsonb_build_object('k', anonproxy.k_anonymity(measured, qi, case when unit is not null then '_unit' end));
    if sensitive is not null then
        achieved := achieved || jsonb_build_object(
            'l_distinct', anonproxy.l_diversity(measured, qi, sensitive, 'distinct'),
            'l_entropy', anonproxy.l_diversity(measured, qi, sensitive, 'entropy'),
            'l_recursive_c', case when spec ->> 'l_kind' = 'recursive' and spec ->> 'l' is not null then
                anonproxy.l_diversity(measured, qi, sensitive, 'recursive', (spec ->> 'l')::integer) end,
            't', anonproxy.t_closeness(measured, qi, sensitive, distance,
                                       case when distance = 'hierarchical' then spec -> 'sensitive' ->> 'hierarchy' end),
            't_distance', distance);
    end if;
    if unit is not null then
        drop table pg_temp.anonproxy_measured;
    end if;
    metrics := anonproxy.utility('pg_temp.anonproxy_input', target, qi,
                                 (select jsonb_object_agg(q ->> 'name', q -> 'hierarchy')
                                    from jsonb_array_elements(spec -> 'qi') q where q ->> 'hierarchy' is not null),
                                 (spec ->> 'k')::integer);

    failed := case
        when (achieved ->> 'k')::bigint < (spec ->> 'k')::bigint then
            format('is not k-anonymous for k = %s: its smallest class has %s privacy units', spec ->> 'k', achieved ->> 'k')
        when spec ->> 'l' is null then null
        when spec ->> 'l_kind' = 'distinct' and (achieved ->> 'l_distinct')::numeric < (spec ->> 'l')::numeric then
            format('is only distinct %s-diverse, not %s', achieved ->> 'l_distinct', spec ->> 'l')
        when spec ->> 'l_kind' = 'entropy' and (achieved ->> 'l_entropy')::numeric < (spec ->> 'l')::numeric then
            format('is only entropy %s-diverse, not %s', achieved ->> 'l_entropy', spec ->> 'l')
        when spec ->> 'l_kind' = 'recursive' and (achieved ->> 'l_recursive_c')::numeric >= (spec ->> 'c')::numeric then
            format('is not recursive (%s,%s)-diverse: it needs c above %s', spec ->> 'c', spec ->> 'l',
                   achieved ->> 'l_recursive_c')
        end;
    if failed is null and spec ->> 't' is not null and (achieved ->> 't')::numeric > (spec ->> 't')::numeric then
        failed := format('is only %s-close (%s distance), not %s', achieved ->> 't', distance, spec ->> 't');
    end if;
    if failed is null and (metrics ->> 'suppressed_rows')::numeric
                          > floor((spec ->> 'suppression_limit')::numeric * (metrics ->> 'rows_source')::numeric) then
        failed := format('suppresses %s of %s rows, more than the suppression limit %s', metrics ->> 'suppressed_rows',
                         metrics ->> 'rows_source', spec ->> 'suppression_limit');
    end if;
    if failed is not null then
        raise exception using errcode = 'XX000',
            message = format('the table method %s produced %s; nothing was created', method, failed),
            hint = 'the method did not meet its own guarantee: report this with the arguments used';
    end if;
    return jsonb_build_object('achieved', achieved, 'metrics', metrics);
end
$$;

create function anonproxy.release_drop_staging() returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    drop table pg_temp.anonproxy_input, pg_temp.anonproxy_output;
end
$$;

-- The summary row of a registered release.
create function anonproxy.release_summary_of(release_id bigint, started timestamptz) returns anonproxy.release_summary
language sql stable set search_path = pg_catalog, pg_temp as $$
    select row(r.id, r.target, r.method, (r.achieved ->> 'k')::bigint,
               case r.parameters ->> 'l_kind' when 'entropy' then (r.achieved ->> 'l_entropy')::numeric
                    else (r.achieved ->> 'l_distinct')::numeric end,
               (r.achieved ->> 'l_recursive_c')::numeric,
               trim_scale((r.achieved ->> 't')::numeric),
               (r.metrics ->> 'equivalence_classes')::bigint, (r.metrics ->> 'suppressed_rows')::bigint,
               round((r.metrics ->> 'ncp')::numeric, 6), round((r.metrics ->> 'sse_sst')::numeric, 6),
               clock_timestamp() - started)::anonproxy.release_summary
      from anonproxy.releases r where r.id = release_id
$$;


-- Entry points -----------------------------------------------------------------

-- create_anonymized_view once the target is resolved to its registry name.
create function anonproxy.release_create(
    source regclass, target_name text, quasi_identifiers text[], sensitive text, k integer, l numeric, l_kind text,
    c numeric, t numeric, t_distance text, method text, suppression_limit numeric, unit text, hierarchies jsonb,
    force boolean
) returns anonproxy.release_summary
-- Sorts and hashes of a large release stay in memory (work_mem applies per sort or hash).
language plpgsql set search_path = pg_catalog, pg_temp set work_mem = '128MB' as $$
declare
    started timestamptz := pg_catalog.clock_timestamp();
    spec jsonb;
    facts jsonb;
    measured jsonb;
    new_id bigint;
begin
    perform anonproxy.release_check_target(target_name);
    spec := anonproxy.release_spec(source, quasi_identifiers, sensitive, k, l, l_kind, c, t, t_distance, method,
                                   suppression_limit, unit, hierarchies);
    perform anonproxy.release_progress(1, 5, 'copying ' || source::text);
    perform anonproxy.release_stage(source, spec, unit);
    perform anonproxy.release_progress(2, 5, 'anonymizing with ' || method);
    facts := anonproxy.release_run(method, spec);
    perform anonproxy.release_progress(3, 5, 'writing ' || target_name);
    execute pg_catalog.format('create table %s as %s', target_name, anonproxy.release_rows(source, spec));
    perform anonproxy.release_progress(4, 5, 'measuring ' || target_name);
    measured := anonproxy.release_measure(target_name::regclass, method, spec, unit);

    insert into anonproxy.releases (source, target, method, quasi_identifiers, sensitive, unit, parameters,
                                    method_facts, achieved, metrics, forced)
    select pg_catalog.format('%I.%I', n.nspname, cl.relname), target_name, method, quasi_identifiers, sensitive, unit,
           anonproxy.release_parameters(spec), facts, measured -> 'achieved', measured -> 'metrics', false
      from pg_catalog.pg_class cl join pg_catalog.pg_namespace n on n.oid = cl.relnamespace
     where cl.oid = source
    returning id into new_id;
    perform anonproxy.check_composition(new_id, force);
    perform anonproxy.release_drop_staging();
    perform anonproxy.release_progress(5, 5, 'done');
    return anonproxy.release_summary_of(new_id, started);
end
$$;

create function anonproxy.create_anonymized_view(
    source regclass, target text, quasi_identifiers text[], sensitive text default null, k integer default null,
    l numeric default null, l_kind text default 'entropy', c numeric default null, t numeric default null,
    t_distance text default null, method text default 'mondrian', suppression_limit numeric default 0.0,
    unit text default null, hierarchies jsonb default null, force boolean default false
) returns anonproxy.release_summary
language sql as $$
    select * from anonproxy.release_create(
        source, anonproxy.release_target_name(target, pg_catalog.current_schema()), quasi_identifiers, sensitive,
        k, l, l_kind, c, t, t_distance, method, suppression_limit, unit, hierarchies, force)
$$;

-- What the registry keeps to re-run a release: the arguments, with the
-- hierarchy each column used resolved (null: none).
create function anonproxy.release_parameters(spec jsonb) returns jsonb
language sql immutable set search_path = pg_catalog, pg_temp as $$
    select jsonb_build_object(
        'k', spec -> 'k', 'l', spec -> 'l', 'l_kind', spec -> 'l_kind', 'c', spec -> 'c', 't', spec -> 't',
        't_distance', spec -> 't_distance', 'suppression_limit', spec -> 'suppression_limit',
        'hierarchies', (select jsonb_object_agg(x ->> 'name', x -> 'hierarchy')
                          from jsonb_array_elements(spec -> 'qi' || case when jsonb_typeof(spec -> 'sensitive') = 'object'
                                                     then jsonb_build_array(spec -> 'sensitive') else '[]' end) x))
$$;

-- Re-run a release with its stored parameters on the source as it is now, and
-- replace the table's rows in this transaction (readers see the old rows until commit).
create function anonproxy.release_refresh(target_name text, force boolean) returns anonproxy.release_summary
-- Sorts and hashes of a large release stay in memory (work_mem applies per sort or hash).
language plpgsql set search_path = pg_catalog, pg_temp set work_mem = '128MB' as $$
declare
    started timestamptz := pg_catalog.clock_timestamp();
    release anonproxy.releases := anonproxy.release_of(target_name);
    parameters jsonb := release.parameters;
    source regclass := pg_catalog.to_regclass(release.source);
    spec jsonb;
    facts jsonb;
    measured jsonb;
begin
    if source is null then
        raise exception using errcode = '42P01',
            message = pg_catalog.format('source %s of release %s no longer exists', release.source, release.target),
            hint = pg_catalog.format('drop the release: select anonproxy.drop_release(%L)', release.target);
    end if;
    if pg_catalog.to_regclass(release.target) is null then
        raise exception using errcode = '42P01',
            message = pg_catalog.format('release table %s no longer exists', release.target),
            hint = pg_catalog.format('forget the release with anonproxy.drop_release(%L) and create it again',
                                     release.target);
    end if;
    spec := anonproxy.release_spec(source, release.quasi_identifiers, release.sensitive, (parameters ->> 'k')::integer,
                                   (parameters ->> 'l')::numeric, parameters ->> 'l_kind', (parameters ->> 'c')::numeric,
                                   (parameters ->> 't')::numeric, parameters ->> 't_distance', release.method,
                                   (parameters ->> 'suppression_limit')::numeric, release.unit,
                                   parameters -> 'hierarchies');
    perform anonproxy.release_progress(1, 5, 'copying ' || source::text);
    perform anonproxy.release_stage(source, spec, release.unit);
    perform anonproxy.release_progress(2, 5, 'anonymizing with ' || release.method);
    facts := anonproxy.release_run(release.method, spec);
    perform anonproxy.release_progress(3, 5, 'writing ' || release.target);
    execute pg_catalog.format('delete from %s', release.target);
    execute pg_catalog.format('insert into %s (%s) %s', release.target, anonproxy.release_columns(spec),
                              anonproxy.release_rows(source, spec));
    perform anonproxy.release_progress(4, 5, 'measuring ' || release.target);
    measured := anonproxy.release_measure(release.target::regclass, release.method, spec, release.unit);
    update anonproxy.releases r
       set method_facts = facts, achieved = measured -> 'achieved', metrics = measured -> 'metrics',
           composition = null, refreshed_at = pg_catalog.now()
     where r.id = release.id;
    perform anonproxy.check_composition(release.id, force);
    perform anonproxy.release_drop_staging();
    perform anonproxy.release_progress(5, 5, 'done');
    return anonproxy.release_summary_of(release.id, started);
end
$$;

create function anonproxy.refresh_anonymized_view(target text, force boolean default false)
returns anonproxy.release_summary
language sql as $$
    select * from anonproxy.release_refresh(anonproxy.release_target_name(target, pg_catalog.current_schema()), force)
$$;

-- Drop a release's table (if it is still there) and its registry row.
create function anonproxy.release_drop(target_name text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    release anonproxy.releases := anonproxy.release_of(target_name);
begin
    if pg_catalog.to_regclass(release.target) is not null then
        execute pg_catalog.format('drop table %s', release.target);
    end if;
    delete from anonproxy.releases r where r.id = release.id;
end
$$;

create function anonproxy.drop_release(target text) returns void
language sql as $$
    select anonproxy.release_drop(anonproxy.release_target_name(target, pg_catalog.current_schema()))
$$;
