-- Migration 0009: verification of released tables and utility metrics (issue 5).
--
-- Written independently of the algorithms (0006-0008): nothing here calls or
-- mirrors them, so a bug there cannot hide itself here. Every function reads a
-- table as it is now:
--   k_anonymity  smallest equivalence class (EC: rows sharing all QI values),
--   l_diversity  distinct / entropy / recursive (c,l) diversity of the sensitive column,
--   t_closeness  largest earth mover's distance between an EC and the whole table,
--   utility      information loss and re-identification risk of a release against its source.
-- Generalized cells are read as docs/views-internals.md ("Generalized values")
-- describes them. Criteria (k, l, t) are computed exactly (integer counts, one
-- division at the end) so that a table sitting on a bound is not misjudged by
-- rounding; the entropy l is irrational and rounded to 10 decimal places.
-- Functions run with search_path = pg_catalog, pg_temp and the caller's rights.
-- docs/verify.md describes them for users.


-- The columns of rel, checked to exist, quoted and comma-separated in the order given.
create function anonproxy._verify_column_list(rel regclass, cols text[], what text) returns text
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    bad text;
begin
    if cols is null or cardinality(cols) = 0 or array_position(cols, null) is not null then
        raise exception using errcode = '22023',
            message = format('%s must be a non-empty list of column names without nulls', what);
    end if;
    select c into bad from unnest(cols) c
     where not exists (select from pg_catalog.pg_attribute a
                        where a.attrelid = rel and a.attname = c and a.attnum > 0 and not a.attisdropped)
     limit 1;
    if found then
        raise exception using errcode = '42703',
            message = format('column %I of %s does not exist in %s', bad, what, rel),
            hint = 'names are case-sensitive, as in the table definition';
    end if;
    select c into bad from unnest(cols) c group by c having count(*) > 1 limit 1;
    if found then
        raise exception using errcode = '42701', message = format('column %I is named twice in %s', bad, what);
    end if;
    return (select string_agg(format('%I', c), ', ' order by o) from unnest(cols) with ordinality u(c, o));
end $$;


-- The sensitive column: it must exist and must not be a quasi-identifier.
create function anonproxy._verify_sensitive(rel regclass, qi text[], sensitive text) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
begin
    perform anonproxy._verify_column_list(rel, array[sensitive], 'sensitive');
    if sensitive = any(qi) then
        raise exception using errcode = '22023',
            message = format('column %I is both a quasi-identifier and the sensitive column', sensitive);
    end if;
end $$;


-- Whether a column holds numbers: its (base) type is of the numeric category and
-- converts to numeric, except money (its text is '$1.00'); oid and reg* do not.
create function anonproxy._verify_is_number(rel regclass, col text) returns boolean
language sql stable set search_path = pg_catalog, pg_temp as $$
    select b.typcategory = 'N' and b.oid <> 'money'::regtype
           and (b.oid = 'numeric'::regtype
                or exists (select from pg_catalog.pg_cast c where c.castsource = b.oid and c.casttarget = 'numeric'::regtype))
      from pg_catalog.pg_attribute a join pg_catalog.pg_type t on t.oid = a.atttypid
      join pg_catalog.pg_type b on b.oid = coalesce(nullif(t.typbasetype, 0), t.oid)
     where a.attrelid = rel and a.attname = col and a.attnum > 0
$$;

-- The column as an expression that can be grouped and sorted: itself when its
-- type has a default btree operator class, else its text (json, point, …).
create function anonproxy._verify_sortable(rel regclass, col text) returns text
language sql stable set search_path = pg_catalog, pg_temp as $$
    select case when exists (select from pg_catalog.pg_opclass o join pg_catalog.pg_am m on m.oid = o.opcmethod
                              where m.amname = 'btree' and o.opcdefault
                                and o.opcintype = coalesce(nullif(t.typbasetype, 0), t.oid))
                then format('%I', col) else format('%I::text', col) end
      from pg_catalog.pg_attribute a join pg_catalog.pg_type t on t.oid = a.atttypid
     where a.attrelid = rel and a.attname = col and a.attnum > 0
$$;

-- One row per (EC, sensitive value) of rel: the EC's number, the value as text,
-- the value's rank in the sensitive column's own order over the whole table
-- (its text's order for a type without one), and the number of rows. NULL is a
-- value like any other (sorted last).
create function anonproxy._ec_value_counts(rel regclass, qi text[], sensitive text)
returns table (ec bigint, value text, rank bigint, n bigint)
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    qi_list text := anonproxy._verify_column_list(rel, qi, 'the quasi-identifiers');
    value_sql text;
begin
    perform anonproxy._verify_sensitive(rel, qi, sensitive);
    value_sql := anonproxy._verify_sortable(rel, sensitive);
    return query execute format(
        'select dense_rank() over (order by %1$s), (%2$s)::text, dense_rank() over (order by %2$s), count(*)
           from %3$s group by %1$s, %2$s',
        qi_list, value_sql, rel);
end $$;


create function anonproxy.k_anonymity(rel regclass, qi text[], unit text default null) returns bigint
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    qi_list text := anonproxy._verify_column_list(rel, qi, 'the quasi-identifiers');
    counted text := 'count(*)';
    k bigint;
begin
    if unit is not null then
        counted := format('count(distinct %s)', anonproxy._verify_column_list(rel, array[unit], 'the unit'));
    end if;
    execute format('select min(n) from (select %s as n from %s group by %s) ec', counted, rel, qi_list) into k;
    return k;
end $$;
comment on function anonproxy.k_anonymity(regclass, text[], text) is
    'Size of the smallest equivalence class of rel on the QI columns (distinct units when unit is given); '
    'NULL for an empty table.';


create function anonproxy.l_diversity(rel regclass, qi text[], sensitive text, kind text default 'entropy',
                                      l integer default null) returns numeric
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    result numeric;
begin
    if kind is null or kind not in ('distinct', 'entropy', 'recursive') then
        raise exception using errcode = '22023', message = format('unknown l-diversity kind %L', kind),
            hint = 'kind is distinct, entropy or recursive';
    end if;
    if kind = 'recursive' and (l is null or l < 2) then
        raise exception using errcode = '22023', message = 'recursive (c,l)-diversity needs l >= 2',
            hint = 'pass l => 2 or more; the function returns the c the table achieves for that l';
    end if;
    if kind <> 'recursive' and l is not null then
        raise exception using errcode = '22023', message = format('l is not an argument of %s l-diversity', kind),
            hint = 'only kind => ''recursive'' takes l; the others return the l the table achieves';
    end if;

    if kind = 'distinct' then
        select min(distinct_values) into result
          from (select count(*) as distinct_values from anonproxy._ec_value_counts(rel, qi, sensitive) group by ec) e;
    elsif kind = 'entropy' then
        -- exp(entropy) of an EC of N rows with value counts n_i: exp(ln N - sum(n_i ln n_i) / N).
        select round(min(exp(ln(size) - weighted / size)), 10) into result
          from (select sum(n)::numeric as size, sum(n * ln(n::numeric)) as weighted
                  from anonproxy._ec_value_counts(rel, qi, sensitive) group by ec) e;
    else
        -- r_1 < c * (r_l + ... + r_m) holds exactly for the c above r_1 / (r_l + ... + r_m).
        select max(case when tail = 0 then 'Infinity'::numeric else top::numeric / tail end) into result
          from (select max(n) as top, coalesce(sum(n) filter (where position >= l), 0) as tail
                  from (select c.ec, c.n, row_number() over (partition by c.ec order by c.n desc) as position
                          from anonproxy._ec_value_counts(rel, qi, sensitive) c) ranked
                 group by ec) e;
    end if;
    return result;
end $$;
comment on function anonproxy.l_diversity(regclass, text[], text, text, integer) is
    'distinct: fewest distinct sensitive values in an EC; entropy: smallest exp(entropy) of an EC; '
    'recursive (with l): the smallest c* such that the table is recursive (c,l)-diverse for every c > c*.';


-- EMD between each EC's sensitive distribution P and the whole table's Q, as
-- exact fractions: with N rows in the table, |E| in the EC, n_i and N_i the
-- counts of value i, N*|E|*(p_i - q_i) = n_i*N - N_i*|E| is an integer.
create function anonproxy.t_closeness(rel regclass, qi text[], sensitive text, distance text default 'ordered',
                                      hierarchy text default null) returns numeric
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    tree text := hierarchy;
    height integer;
    missing text;
    result numeric;
begin
    if distance is null or distance not in ('ordered', 'equal', 'hierarchical') then
        raise exception using errcode = '22023', message = format('unknown t-closeness distance %L', distance),
            hint = 'distance is ordered, equal or hierarchical';
    end if;
    if distance <> 'hierarchical' and hierarchy is not null then
        raise exception using errcode = '22023', message = 'a hierarchy is only used by the hierarchical distance';
    end if;
    if distance = 'hierarchical' then
        tree := coalesce(hierarchy,
                         (select c.relname from pg_catalog.pg_class c where c.oid = rel) || '.' || sensitive);
        select h.levels into height from anonproxy.hierarchies h where h.name = tree;
        if not found then
            raise exception using errcode = '42704', message = format('hierarchy %L does not exist', tree),
                hint = 'pass hierarchy => the name of the sensitive column''s hierarchy';
        end if;
    end if;

    if distance = 'hierarchical' then
        -- extra(node) = sum of x over its leaves; an internal node at level L costs
        -- L/height * min(positive, negative extra of its children).
        with counts as (select * from anonproxy._ec_value_counts(rel, qi, sensitive)),
             totals as (select value, sum(n) as total from counts group by value),
             sizes as (select ec, sum(n) as size from counts group by ec),
             whole as (select sum(total) as rows from totals),
             diff as (select s.ec, s.size, t.value, coalesce(c.n, 0) * w.rows - t.total * s.size as x
                        from sizes s cross join totals t cross join whole w
                        left join counts c on c.ec = s.ec and c.value is not distinct from t.value),
             children as (select d.ec, d.size, parent.level, parent.node, child.node as child, sum(d.x) as extra
                            from diff d
                            join anonproxy.hierarchy_nodes parent on parent.hierarchy = tree and parent.leaf = d.value
                            join anonproxy.hierarchy_nodes child on child.hierarchy = tree and child.leaf = d.value
                                                                and child.level = parent.level - 1
                           where parent.level >= 1
                           group by d.ec, d.size, parent.level, parent.node, child.node),
             costs as (select ec, size, level * least(sum(greatest(extra, 0)), sum(greatest(-extra, 0))) as cost
                         from children group by ec, size, level, node)
        select (select max(e.num / (e.size * w.rows * height))
                  from (select ec, size, sum(cost) as num from costs group by ec, size) e),
               (select min(quote_nullable(t.value)) from totals t
                 where not exists (select from anonproxy.hierarchy_nodes h
                                    where h.hierarchy = tree and h.leaf = t.value and h.level = 0))
          into result, missing
          from whole w;
        if missing is not null then
            raise exception using errcode = '22023',
                message = format('value %s of column %I is not a leaf of hierarchy %L', missing, sensitive, tree);
        end if;
    else
        with counts as (select * from anonproxy._ec_value_counts(rel, qi, sensitive)),
             totals as (select rank, sum(n) as total from counts group by rank),
             sizes as (select ec, sum(n) as size from counts group by ec),
             whole as (select sum(total) as rows, count(*) as value_count from totals),
             -- x = N*|E|*(p - q) for every EC and every value of the table
             diff as (select s.ec, s.size, t.rank, coalesce(c.n, 0) * w.rows - t.total * s.size as x
                        from sizes s cross join totals t cross join whole w
                        left join counts c on c.ec = s.ec and c.rank = t.rank)
        select case distance
                 when 'equal' then
                     (select max(d.num / (2 * d.size * w.rows))
                        from (select ec, size, sum(abs(x)) as num from diff group by ec, size) d)
                 when 'ordered' then
                     (select coalesce(max(d.num / (d.size * w.rows * greatest(w.value_count - 1, 1))), 0)
                        from (select ec, size, sum(abs(cumulative)) as num
                                from (select ec, size, sum(x) over (partition by ec order by rank) as cumulative
                                        from diff) running
                               group by ec, size) d)
               end
          into result
          from whole w;
    end if;
    return result;
end $$;
comment on function anonproxy.t_closeness(regclass, text[], text, text, text) is
    'Largest earth mover''s distance between an EC''s sensitive distribution and the whole table''s '
    '(ordered, equal or hierarchical); the table is t-close for every t at or above it.';


-- The hierarchy of a QI column: the one named in hierarchies (it must exist;
-- a JSON null there means none), else the one named '<source table>.<column>'
-- if it exists, else none.
create function anonproxy._verify_hierarchy_of(source regclass, col text, hierarchies jsonb) returns text
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    chosen text := hierarchies ->> col;
begin
    if hierarchies ? col and chosen is null then
        return null;
    elsif chosen is not null then
        if not exists (select from anonproxy.hierarchies h where h.name = chosen) then
            raise exception using errcode = '42704',
                message = format('hierarchy %L named for column %I does not exist', chosen, col),
                hint = 'anonproxy.hierarchies lists the hierarchies';
        end if;
        return chosen;
    end if;
    chosen := (select c.relname from pg_catalog.pg_class c where c.oid = source) || '.' || col;
    return (select h.name from anonproxy.hierarchies h where h.name = chosen);
end $$;


-- Rows of rel per combination of all the columns cols and per value of each,
-- in one scan (grouping sets): {"all": [size of each equivalence class, ...],
-- "<column>": [[value as text, rows], ...], ...}.
create function anonproxy._verify_column_counts(rel regclass, cols text[]) returns jsonb
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    width integer := cardinality(cols);
    col_list text := anonproxy._verify_column_list(rel, cols, 'the quasi-identifiers');
    masks integer[];  -- grouping(c1, ..., cn) in the set of ci alone: every bit but bit n - i
    result jsonb;
begin
    if width > 31 then
        raise exception using errcode = '54011',
            message = format('%s quasi-identifiers: at most 31 are supported', width);
    end if;
    masks := array(select ((1 << width) - 1) # (1 << (width - i)) from generate_series(1, width) i);
    execute format(
        'with sets as (select grouping(%1$s) as g, case grouping(%1$s) %2$s end as value, count(*) as n
                         from %3$s group by grouping sets (%4$s))
         select jsonb_build_object(''all'', (select coalesce(jsonb_agg(n), ''[]'') from sets where g = 0))
                || jsonb_object_agg(names.name, (select coalesce(jsonb_agg(jsonb_build_array(s.value, s.n)), ''[]'')
                                                   from sets s where s.g = names.mask))
           from unnest($1, $2) names(name, mask)',
        col_list,
        (select string_agg(format('when %s then %I::text', m, c), ' ') from unnest(cols, masks) u(c, m)),
        rel,
        '(' || col_list || ')'
            || case when width > 1 then (select string_agg(format(', (%I)', c), '') from unnest(cols) c) else '' end)
        using cols, masks
        into result;
    return result;
end $$;


-- How each distinct generalized (text) cell of a QI column reads against the
-- source column's domain dom (its distinct values): the form of the cell, how
-- many domain values it covers (members) and its normalized certainty penalty:
-- numeric columns: width of the cell (a range's bounds, else the spread of
-- the values it covers) within the column's span, divided by that span;
-- others: (members - 1) / (domain size - 1). form is NULL for an unreadable cell.
create function anonproxy._verify_read_cells(numeric_column boolean, dom text[], cells jsonb, tree text)
returns table (cell text, n bigint, form text, members bigint, ncp double precision)
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    dom_x numeric[];
    low numeric;
    high numeric;
begin
    if numeric_column then
        select array_agg(v::numeric), min(v::numeric), max(v::numeric) into dom_x, low, high from unnest(dom) v;
    end if;

    return query
    with domain as materialized (select v, case when numeric_column then v::numeric end as x from unnest(dom) v),
         forms as materialized (
             select c.cell, c.n,
                    case
                      when c.cell is null or c.cell = any(dom) then 'value'
                      when numeric_column and c.cell ~ '^-?[0-9]+(\.[0-9]+)?$' and c.cell::numeric = any(dom_x)
                          then 'value'
                      when c.cell = '*' then 'any'
                      when numeric_column and c.cell ~ '^-?[0-9]+(\.[0-9]+)?--?[0-9]+(\.[0-9]+)?$' then 'range'
                      when c.cell ~ '^\{.*\}$' then 'set'
                      when exists (select from anonproxy.hierarchy_nodes h
                                    where h.hierarchy = tree and h.node = c.cell and h.level > 0) then 'node'
                    end as form,
                    case when numeric_column then
                        (regexp_match(c.cell, '^(-?[0-9]+(?:\.[0-9]+)?)-(-?[0-9]+(?:\.[0-9]+)?)$'))::numeric[]
                    end as bounds
               from (select e ->> 0 as cell, (e ->> 1)::bigint as n from jsonb_array_elements(cells) e) c),
         covered as (
             select f.cell, f.n, f.form, f.bounds, count(d.v) as members, min(d.x) as least_x, max(d.x) as greatest_x
               from forms f
               left join domain d on case f.form
                                       when 'any' then true
                                       when 'range' then d.x between f.bounds[1] and f.bounds[2]
                                       when 'set' then d.v = any(f.cell::text[])
                                       when 'node' then exists (select from anonproxy.hierarchy_nodes h
                                                                 where h.hierarchy = tree and h.node = f.cell
                                                                   and h.leaf = d.v)
                                       else false
                                     end
              group by f.cell, f.n, f.form, f.bounds)
    select c.cell, c.n, c.form,
           case when c.form = 'value' then 1 else c.members end,
           case
             when c.form = 'value' or c.members = 0 then 0
             when numeric_column then
                 case when high = low then 0
                      else ((least(coalesce(c.bounds[2], c.greatest_x), high)
                             - greatest(coalesce(c.bounds[1], c.least_x), low)) / (high - low))::double precision
                 end
             else
                 case when cardinality(dom) <= 1 then 0
                      else (c.members - 1)::double precision / (cardinality(dom) - 1) end
           end
      from covered c;
end $$;


create function anonproxy.utility(source regclass, target regclass, qi text[], hierarchies jsonb default null,
                                  k integer default null, risk_threshold double precision default 0.1) returns jsonb
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    source_counts jsonb;   -- anonproxy._verify_column_counts of the source
    target_counts jsonb;   -- ... and of the release
    total bigint;          -- source rows, |D|
    ec record;
    suppressed bigint;
    source_n_ln_n double precision;
    col text;
    dom text[];
    tree text;
    numeric_column boolean;
    numeric_target boolean;
    cells record;
    bad text;
    mean numeric;
    total_square numeric;
    between_square numeric;
    ncp_per_qi jsonb := '{}';
    sse_sst_per_qi jsonb := '{}';
    log_volume double precision := 0;  -- mean over source rows of ln(cells covered), summed over QIs
    kl_defined boolean := true;
begin
    if hierarchies is not null and (jsonb_typeof(hierarchies) <> 'object'
            or exists (select from jsonb_each(hierarchies) e
                        where not e.key = any(qi) or jsonb_typeof(e.value) not in ('string', 'null'))) then
        raise exception using errcode = '22023',
            message = 'hierarchies must be a JSON object mapping quasi-identifier columns to hierarchy names',
            hint = 'e.g. {"education": "adult.education"}; null: the column has no hierarchy';
    end if;
    if risk_threshold is null or risk_threshold <= 0 or risk_threshold > 1 then
        raise exception using errcode = '22023', message = format('risk_threshold %s is not in (0, 1]', risk_threshold);
    end if;
    if k is not null and k < 1 then
        raise exception using errcode = '22023', message = format('k %s is not a positive integer', k);
    end if;

    source_counts := anonproxy._verify_column_counts(source, qi);
    target_counts := anonproxy._verify_column_counts(target, qi);
    select coalesce(sum(n::bigint), 0), sum(n::double precision * ln(n::double precision))
      into total, source_n_ln_n
      from jsonb_array_elements_text(source_counts -> 'all') n;
    if total = 0 then
        raise exception using errcode = '22023',
            message = format('source %s is empty: there is nothing to measure', source);
    end if;
    select count(*) as classes, coalesce(sum(n), 0) as rows, sum(n * n) as square, min(n) as smallest,
           sum(n * ln(n::double precision)) as n_ln_n,
           coalesce(sum(n) filter (where 1 / n::double precision > risk_threshold), 0) as at_risk
      into ec
      from (select e::bigint as n from jsonb_array_elements_text(target_counts -> 'all') e) sizes;
    suppressed := total - ec.rows;
    if suppressed < 0 then
        raise exception using errcode = '22023',
            message = format('%s has %s rows, more than its source %s (%s rows)', target, ec.rows, source, total),
            hint = 'the source changed since the release was built: refresh the release';
    end if;

    foreach col in array qi loop
        numeric_column := anonproxy._verify_is_number(source, col);
        numeric_target := anonproxy._verify_is_number(target, col);
        dom := array(select e ->> 0 from jsonb_array_elements(source_counts -> col) e where e ->> 0 is not null);
        if numeric_target then
            -- Centroids (microaggregation): no generalization, so NCP 0 for a released
            -- cell and SSE/SST = 1 - SSB/SST, exact when each centroid is its class mean
            -- (a suppressed row counts as replaced by the overall mean).
            execute format('select avg(%1$I::numeric), var_pop(%1$I::numeric) * count(%1$I) from %2$s', col, source)
                into mean, total_square;
            if mean is null then
                raise exception using errcode = '42804',
                    message = format('column %I is numeric in %s but has no numeric values in %s', col, target, source);
            end if;
            execute format('select coalesce(sum((%1$I::numeric - $1) ^ 2), 0) from %2$s', col, target)
                using mean into between_square;
            kl_defined := false;  -- a centroid is not a cell of the source domain
            log_volume := log_volume + suppressed * ln(greatest(cardinality(dom), 1)) / total;
            ncp_per_qi := ncp_per_qi || jsonb_build_object(col, suppressed::double precision / total);
            sse_sst_per_qi := sse_sst_per_qi || jsonb_build_object(col,
                case when total_square = 0 then 0 else round(1 - between_square / total_square, 12) end);
            continue;
        end if;
        tree := anonproxy._verify_hierarchy_of(source, col, hierarchies);
        select sum(c.n * c.ncp) as ncp, sum(c.n * ln(greatest(c.members, 1))) as log_members,
               min(coalesce(c.cell, 'NULL')) filter (where c.form is null) as unreadable,
               min(c.cell) filter (where c.members = 0) as empty
          into cells
          from anonproxy._verify_read_cells(numeric_column, dom, target_counts -> col, tree) c;
        bad := coalesce(cells.unreadable, cells.empty);
        if bad is not null then
            raise exception using errcode = '22P02',
                message = format('cannot read the value %L of column %I of %s against %s', bad, col, target, source),
                detail = case when cells.unreadable is null then 'it covers no value of the source column'
                              else 'it is not an original value, a range lo-hi of a numeric column, a {set}, *, '
                                   || 'or a node of the column''s hierarchy ' || coalesce(quote_literal(tree), '(none)')
                         end,
                hint = 'pass hierarchies => {"column": "hierarchy name"} when the column uses a hierarchy';
        end if;
        ncp_per_qi := ncp_per_qi || jsonb_build_object(col, (coalesce(cells.ncp, 0) + suppressed) / total);
        log_volume := log_volume
            + (coalesce(cells.log_members, 0) + suppressed * ln(greatest(cardinality(dom), 1))) / total;
    end loop;

    return jsonb_build_object(
        'rows_source', total,
        'rows_released', ec.rows,
        'suppressed_rows', suppressed,
        'equivalence_classes', ec.classes,
        'discernibility', coalesce(ec.square, 0) + total * suppressed,
        'avg_ec_size', ec.rows::double precision / nullif(ec.classes, 0),
        'c_avg', ec.rows::double precision / nullif(ec.classes, 0) / coalesce(k, ec.smallest),
        'ncp', (select avg(v::double precision) from jsonb_each_text(ncp_per_qi) e(c, v)),
        'ncp_per_qi', ncp_per_qi,
        -- KL(source || uniform-within-cell reconstruction), each row scored in its own class:
        -- H(classes) - H(source QI tuples) + E[ln cells covered]; suppressed rows form one class of '*'.
        'kl_divergence', case when kl_defined then
            (source_n_ln_n
             - coalesce(ec.n_ln_n, 0) - case when suppressed > 0 then suppressed * ln(suppressed) else 0 end) / total
            + log_volume end,
        'sse_sst', (select avg(v::double precision) from jsonb_each_text(sse_sst_per_qi) e(c, v)),
        'sse_sst_per_qi', sse_sst_per_qi,
        'prosecutor_max_risk', 1 / ec.smallest::double precision,
        'risk_threshold', risk_threshold,
        'records_above_risk_threshold', ec.at_risk::double precision / nullif(ec.rows, 0),
        'ec_per_record', ec.classes::double precision / nullif(ec.rows, 0));
end $$;
comment on function anonproxy.utility(regclass, regclass, text[], jsonb, integer, double precision) is
    'Information loss and re-identification risk of a release (target) against its source; '
    'docs/verify.md lists the keys.';
