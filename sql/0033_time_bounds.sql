-- Migration 0033: declared bounds of date, timestamp and timestamptz columns (time bounds).
--
-- A time column's bounds are the public range its values lie in (inclusive), as a numeric column's lower and upper
-- bounds are: dp mode lists the calendar buckets of that range as a public domain (docs/dp.md, "Time domains"),
-- and leaves rows outside it out of those buckets. They are stored as timestamps without time zone: for a
-- timestamptz column the UTC time, for a timestamp column the value itself, for a date column its midnight.
--
-- anonproxy.set_time_bounds(table, column, earliest, latest) sets them (both NULL: clears them) on a column that
-- already has a policy (anonproxy.set_column). The bounds are given as text and read as the column's type; a
-- timestamptz bound without an offset is UTC, whatever the caller's TimeZone (the same text, the same bound).

alter table anonproxy.column_policies
    add column earliest timestamp,
    add column latest timestamp,
    add constraint time_bounds_both_or_neither check ((earliest is null) = (latest is null)),
    add constraint time_bounds_ordered check (earliest <= latest),
    add constraint time_bounds_finite check (pg_catalog.isfinite(earliest) and pg_catalog.isfinite(latest));
comment on column anonproxy.column_policies.earliest is
    'Declared first value of a date, timestamp or timestamptz column, inclusive (UTC for timestamptz).';
comment on column anonproxy.column_policies.latest is
    'Declared last value of a date, timestamp or timestamptz column, inclusive (UTC for timestamptz).';

-- One bound read as the column's type, to the stored timestamp; an error naming the column when it is not a
-- finite value of that type between years 1 and 9999 (what the proxy's model holds).
create function anonproxy.time_bound(bound text, column_type regtype, side text, qualified text) returns timestamp
language plpgsql stable set search_path = pg_catalog, pg_temp set timezone = 'UTC' as $$
declare
    value timestamp;
begin
    begin
        if column_type = 'pg_catalog.timestamptz'::regtype then
            value := bound::timestamptz at time zone 'UTC';
        elsif column_type = 'pg_catalog.date'::regtype then
            value := bound::timestamp;
        else
            value := bound::timestamp;
        end if;
    exception when invalid_datetime_format or datetime_field_overflow or invalid_parameter_value then
        raise exception using errcode = sqlstate,
            message = format('%s bound %L of column %s is not a valid %s', side, bound, qualified, column_type),
            hint = 'write it as PostgreSQL reads the column''s type, like 2025-01-01 or 2025-01-01 00:00:00+00';
    end;
    if column_type = 'pg_catalog.date'::regtype and value <> value::date then
        raise exception using errcode = '22007',
            message = format('%s bound %L of date column %s is not a date', side, bound, qualified);
    end if;
    if not pg_catalog.isfinite(value) or value < '0001-01-01'::timestamp or value >= '10000-01-01'::timestamp then
        raise exception using errcode = '22008',
            message = format('%s bound %L of column %s is outside years 1 to 9999', side, bound, qualified),
            hint = 'declare a finite bound: the range the column''s values really lie in';
    end if;
    return value;
end
$$;

create function anonproxy.set_time_bounds(tbl regclass, column_name name, earliest text, latest text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
    qualified text := format('%s.%I', target, column_name);
    column_type regtype := anonproxy.column_type(tbl, column_name);
    first_value timestamp;
    last_value timestamp;
begin
    if not exists (select from anonproxy.column_policies c
                    where c.table_name = target and c.column_name = set_time_bounds.column_name) then
        raise exception using errcode = '42704', message = format('column %s has no policy', qualified),
            hint = format('declare its kind first: select anonproxy.set_column(%L, %L, <kind>)', target, column_name);
    end if;
    if (earliest is null) <> (latest is null) then
        raise exception using errcode = '22023',
            message = format('column %s needs both an earliest and a latest bound, or neither', qualified);
    end if;
    if earliest is not null and column_type not in ('pg_catalog.date'::regtype, 'pg_catalog.timestamp'::regtype,
                                                    'pg_catalog.timestamptz'::regtype) then
        raise exception using errcode = '42804',
            message = format('column %s is of type %s; time bounds need a date, timestamp or timestamptz column',
                             qualified, column_type);
    end if;
    if earliest is not null then
        first_value := anonproxy.time_bound(earliest, column_type, 'earliest', qualified);
        last_value := anonproxy.time_bound(latest, column_type, 'latest', qualified);
        if first_value > last_value then
            raise exception using errcode = '22023',
                message = format('earliest bound %s is later than latest bound %s for column %s',
                                 earliest, latest, qualified);
        end if;
    end if;
    update anonproxy.column_policies c set earliest = first_value, latest = last_value
     where c.table_name = target and c.column_name = set_time_bounds.column_name;
end
$$;

revoke execute on function
    anonproxy.time_bound(text, regtype, text, text),
    anonproxy.set_time_bounds(regclass, name, text, text)
from public;
