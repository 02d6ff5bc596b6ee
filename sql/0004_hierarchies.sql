-- Migration 0004: generalization hierarchies (issue 5).
--
-- A hierarchy maps every original value (a leaf) to one ancestor per level:
-- level 0 is the leaf itself, level `levels` is the single top (usually '*').
-- Algorithms read it to generalize a quasi-identifier; the verification
-- functions read it to know which leaves a generalized cell stands for. So a
-- stored hierarchy is always a consistent tree (anonproxy.validate_hierarchy):
-- every leaf has every level, there is one top, a node has one parent, and a
-- label means one set of leaves wherever it appears.
--
-- Fill one with anonproxy.load_hierarchy (rows as a text[][], e.g. from an ARX
-- CSV file: `anonproxy hierarchy load`), build_interval_hierarchy (numeric
-- ranges) or build_prefix_hierarchy (ZIP-style masking). Numeric leaves are the
-- text of the number ('39'). Functions run with search_path = pg_catalog,
-- pg_temp and the caller's rights. docs/views.md describes them for users.

create table anonproxy.hierarchies (
    name text primary key constraint hierarchy_name_not_empty check (name <> ''),
    levels integer not null constraint hierarchy_has_levels check (levels >= 1),
    kind text not null constraint hierarchy_kind check (kind in ('explicit', 'interval', 'prefix')),
    created_at timestamptz not null default now()
);
comment on table anonproxy.hierarchies is
    'Generalization hierarchies; levels is the index of the top level (a leaf is level 0).';

create table anonproxy.hierarchy_nodes (
    hierarchy text not null references anonproxy.hierarchies (name) on delete cascade,
    leaf text not null,
    level integer not null constraint node_level check (level >= 0),
    node text not null,
    primary key (hierarchy, leaf, level)
);
comment on table anonproxy.hierarchy_nodes is
    'The ancestor (node) of each leaf at each level of a hierarchy.';
-- Reading a generalized cell back: which leaves does this node cover?
create index hierarchy_nodes_by_node on anonproxy.hierarchy_nodes (hierarchy, node, level);

-- No grant to PUBLIC: a hierarchy built from a column (build_interval_hierarchy,
-- build_prefix_hierarchy) lists every distinct value of it as a leaf. Readers
-- need an explicit grant (docs/views.md, "Rights").


-- Raise the first inconsistency of a stored hierarchy, naming it.
create function anonproxy.validate_hierarchy(name text) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    top integer;
    bad record;
begin
    select h.levels into top from anonproxy.hierarchies h where h.name = validate_hierarchy.name;
    if not found then
        raise exception using errcode = '42704', message = format('hierarchy %L does not exist', name),
            hint = 'anonproxy.hierarchies lists the hierarchies';
    end if;
    if not exists (select from anonproxy.hierarchy_nodes n where n.hierarchy = name) then
        raise exception using errcode = '22023', message = format('hierarchy %L has no leaves', name);
    end if;

    select n.leaf, count(*) as levels into bad
      from anonproxy.hierarchy_nodes n
     where n.hierarchy = name
     group by n.leaf
    having count(*) <> top + 1 or max(n.level) <> top
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: leaf %L has %s levels, not the %s levels 0..%s of the hierarchy',
                             name, bad.leaf, bad.levels, top + 1, top),
            hint = 'every leaf needs an ancestor at every level';
    end if;

    select n.leaf, n.node into bad
      from anonproxy.hierarchy_nodes n
     where n.hierarchy = name and n.level = 0 and n.node <> n.leaf
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: level 0 of leaf %L is %L; level 0 must be the leaf itself',
                             name, bad.leaf, bad.node);
    end if;

    if (select count(distinct n.node) from anonproxy.hierarchy_nodes n
         where n.hierarchy = name and n.level = top) > 1 then
        raise exception using errcode = '22023',
            message = format('hierarchy %L has several nodes at its top level %s: %s', name, top,
                             (select string_agg(distinct quote_literal(n.node), ', ')
                                from anonproxy.hierarchy_nodes n where n.hierarchy = name and n.level = top)),
            hint = 'the top level must be one node covering every value, usually *';
    end if;

    select child.level, child.node, array_agg(distinct parent.node order by parent.node) as parents into bad
      from anonproxy.hierarchy_nodes child
      join anonproxy.hierarchy_nodes parent
        on parent.hierarchy = child.hierarchy and parent.leaf = child.leaf and parent.level = child.level + 1
     where child.hierarchy = name
     group by child.level, child.node
    having count(distinct parent.node) > 1
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: node %L at level %s has several parents: %s',
                             name, bad.node, bad.level, array_to_string(bad.parents, ', ')),
            hint = 'a hierarchy is a tree: all leaves under a node must share its ancestors';
    end if;

    -- A release cell holds a label only, so a label must stand for the same leaves at every level.
    select covers.node, array_agg(covers.level order by covers.level) as levels into bad
      from (select n.node, n.level, array_agg(n.leaf order by n.leaf) as leaves
              from anonproxy.hierarchy_nodes n
             where n.hierarchy = name
             group by n.node, n.level) covers
     group by covers.node
    having count(distinct covers.leaves) > 1
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: label %L stands for different sets of values at levels %s',
                             name, bad.node, array_to_string(bad.levels, ', ')),
            hint = 'rename one of them, so that a generalized cell can be read back';
    end if;
end
$$;

-- Create the header row of a hierarchy, replacing an existing one only when asked.
create function anonproxy.start_hierarchy(name text, levels integer, kind text, replace boolean) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if name is null or name = '' then
        raise exception using errcode = '22004', message = 'hierarchy name must not be null or empty';
    end if;
    if exists (select from anonproxy.hierarchies h where h.name = start_hierarchy.name) then
        if not coalesce(replace, false) then
            raise exception using errcode = '42710', message = format('hierarchy %L already exists', name),
                hint = format('pass replace => true, or drop it first: select anonproxy.drop_hierarchy(%L)', name);
        end if;
        delete from anonproxy.hierarchies h where h.name = start_hierarchy.name;
    end if;
    insert into anonproxy.hierarchies (name, levels, kind) values (name, levels, kind);
end
$$;

-- rows: one row per leaf, columns = levels 0..n (the layout of an ARX CSV file).
-- Returns the number of leaves.
create function anonproxy.load_hierarchy(name text, rows text[], replace boolean default false) returns integer
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    bad record;
begin
    if rows is null or array_ndims(rows) is distinct from 2 then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: rows must be a two-dimensional text array', name),
            hint = 'one row per value, one column per level: ARRAY[[''Male'', ''*''], [''Female'', ''*'']]';
    end if;
    if array_length(rows, 2) < 2 then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: rows have %s column; at least the value and the top are needed',
                             name, array_length(rows, 2));
    end if;
    perform anonproxy.start_hierarchy(name, array_length(rows, 2) - 1, 'explicit', replace);

    select i - array_lower(rows, 1) + 1 as line, j - array_lower(rows, 2) as level into bad
      from generate_subscripts(rows, 1) i, generate_subscripts(rows, 2) j
     where rows[i][j] is null or rows[i][j] = ''
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: row %s has no value at level %s', name, bad.line, bad.level);
    end if;

    select rows[i][array_lower(rows, 2)] as leaf, array_agg(i - array_lower(rows, 1) + 1) as lines into bad
      from generate_subscripts(rows, 1) i
     group by 1
    having count(*) > 1
     limit 1;
    if found then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: value %L has several rows (%s)', name, bad.leaf,
                             array_to_string(bad.lines, ', '));
    end if;

    insert into anonproxy.hierarchy_nodes (hierarchy, leaf, level, node)
    select load_hierarchy.name, rows[i][array_lower(rows, 2)], j - array_lower(rows, 2), rows[i][j]
      from generate_subscripts(rows, 1) i, generate_subscripts(rows, 2) j;
    perform anonproxy.validate_hierarchy(name);
    return array_length(rows, 1);
end
$$;

-- The builders check columns with 0002's column_type (and the name it reports
-- with policy_table_name). Both only read the catalogs, which every role may
-- read, so any role that may build a hierarchy may call them.
grant execute on function anonproxy.column_type(regclass, name), anonproxy.policy_table_name(regclass)
    to public;

-- Distinct non-null values of source.column as text.
create function anonproxy.hierarchy_source_values(source regclass, column_name text) returns setof text
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
begin
    perform anonproxy.column_type(source, column_name);
    return query execute format('select distinct %1$I::text from %2$s where %1$I is not null', column_name, source);
end
$$;

-- Intervals of growing width over an integer column: widths {5, 10, 20} give
-- 39 -> 35-39 -> 30-39 -> 20-39 -> *. Each width is a multiple of the one
-- before, and intervals start at multiples of their width, so they nest.
create function anonproxy.build_interval_hierarchy(
    name text, source regclass, column_name text, widths numeric[], replace boolean default false
) returns integer
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    leaves integer;
    value_type regtype;
begin
    if widths is null or cardinality(widths) = 0 or array_ndims(widths) <> 1
       or exists (select from unnest(widths) w where w is null or w < 1 or w <> trunc(w)) then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: widths must be a non-empty list of whole numbers >= 1', name),
            hint = 'for example ARRAY[5, 10, 20]';
    end if;
    if exists (select from generate_subscripts(widths, 1) i
                where i > array_lower(widths, 1) and widths[i] % widths[i - 1] <> 0) then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: each width must be a multiple of the one before, not %s', name,
                             array_to_string(widths, ', ')),
            hint = 'nested intervals need it, for example ARRAY[5, 10, 20]';
    end if;
    value_type := anonproxy.column_type(source, column_name);
    if value_type not in ('smallint'::regtype, 'integer'::regtype, 'bigint'::regtype) then
        raise exception using errcode = '42804',
            message = format('column %I of %s is %s; interval hierarchies are built over integer columns',
                             column_name, source, value_type),
            hint = 'load an explicit hierarchy with anonproxy.load_hierarchy for other types';
    end if;
    perform anonproxy.start_hierarchy(name, cardinality(widths) + 1, 'interval', replace);
    with leaf as (
        select v.value, v.value::bigint as n from anonproxy.hierarchy_source_values(source, column_name) v(value)
    )
    insert into anonproxy.hierarchy_nodes (hierarchy, leaf, level, node)
    select build_interval_hierarchy.name, leaf.value, 0, leaf.value from leaf
    union all
    select build_interval_hierarchy.name, leaf.value, w.level,
           format('%s-%s', (floor(leaf.n / w.width) * w.width)::bigint,
                  (floor(leaf.n / w.width) * w.width + w.width - 1)::bigint)
      from leaf, unnest(widths) with ordinality as w(width, level)
    union all
    select build_interval_hierarchy.name, leaf.value, cardinality(widths) + 1, '*' from leaf;
    get diagnostics leaves = row_count;
    leaves := leaves / (cardinality(widths) + 2);
    perform anonproxy.validate_hierarchy(name);
    return leaves;
end
$$;

-- Mask the last characters: levels = 2 gives 47677 -> 4767* -> 476** -> *.
create function anonproxy.build_prefix_hierarchy(
    name text, source regclass, column_name text, levels integer, replace boolean default false
) returns integer
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    leaves integer;
    shortest integer;
begin
    if levels is null or levels < 1 then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: levels must be at least 1, not %s', name, coalesce(levels::text, 'null'));
    end if;
    select min(length(v.value)) into shortest from anonproxy.hierarchy_source_values(source, column_name) v(value);
    if shortest is null then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: column %I of %s has no values', name, column_name, source);
    end if;
    if levels >= shortest then
        raise exception using errcode = '22023',
            message = format('hierarchy %L: %s masking levels would hide the whole of the shortest value (%s characters)',
                             name, levels, shortest),
            hint = format('use at most %s levels', shortest - 1);
    end if;
    perform anonproxy.start_hierarchy(name, levels + 1, 'prefix', replace);
    with leaf as (select v.value from anonproxy.hierarchy_source_values(source, column_name) v(value))
    insert into anonproxy.hierarchy_nodes (hierarchy, leaf, level, node)
    select build_prefix_hierarchy.name, leaf.value, level,
           left(leaf.value, length(leaf.value) - level) || repeat('*', level)
      from leaf, generate_series(0, levels) level
    union all
    select build_prefix_hierarchy.name, leaf.value, levels + 1, '*' from leaf;
    get diagnostics leaves = row_count;
    leaves := leaves / (levels + 2);
    perform anonproxy.validate_hierarchy(name);
    return leaves;
end
$$;

create function anonproxy.drop_hierarchy(name text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    delete from anonproxy.hierarchies h where h.name = drop_hierarchy.name;
    if not found then
        raise exception using errcode = '42704', message = format('hierarchy %L does not exist', name),
            hint = 'anonproxy.hierarchies lists the hierarchies';
    end if;
end
$$;
