-- Migration 0020: dp_interval_low(x) / dp_interval_high(x), the 95 % interval bounds of a noisy dp answer.
--
-- The proxy answers them itself, in the select list of a dp-mode query (docs/dp.md, "Intervals"): it plans
-- dp_interval_low(avg(age)) as avg(age), with the same noisy statistics, and returns an end of that value's
-- interval instead of the value. No noise exists outside that path, so these functions, called by PostgreSQL
-- itself (a direct connection, a pass-through role, a suppress-mode answer), only say so: SQLSTATE 0A000.
-- They exist so that the names are known to the catalog and a direct call gets that message rather than
-- "function does not exist"; they live in the anonproxy schema only (not on anyone's search_path), so an
-- unqualified call outside the proxy is still PostgreSQL's 42883.

create function anonproxy.dp_interval_low(value anyelement) returns anyelement
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise exception 'dp_interval_low() answers only in dp mode, through anonproxy'
        using errcode = '0A000',
              hint = 'Connect through the anonproxy proxy as a dp-mode role: it returns the lower end of the '
                     '95 % interval of each noisy aggregate, e.g. SELECT avg(age), dp_interval_low(avg(age)) ...';
end
$$;

create function anonproxy.dp_interval_high(value anyelement) returns anyelement
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise exception 'dp_interval_high() answers only in dp mode, through anonproxy'
        using errcode = '0A000',
              hint = 'Connect through the anonproxy proxy as a dp-mode role: it returns the upper end of the '
                     '95 % interval of each noisy aggregate, e.g. SELECT avg(age), dp_interval_high(avg(age)) ...';
end
$$;

comment on function anonproxy.dp_interval_low(anyelement) is
    'Lower end of the 95 % interval of a noisy dp aggregate; answered by the anonproxy proxy in dp mode only.';
comment on function anonproxy.dp_interval_high(anyelement) is
    'Upper end of the 95 % interval of a noisy dp aggregate; answered by the anonproxy proxy in dp mode only.';
