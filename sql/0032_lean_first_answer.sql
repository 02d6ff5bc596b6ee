-- Migration 0032: what a dp question's first answer waits for in the ledger, cut (issue 23: first charge <= 2 ms).
--
-- * data_version runs twice per new question (the lookup, then the measurement's snapshot) and once per question
--   already answered. Its one query takes the tables as a parameter; under plan_cache_mode = auto, PL/pgSQL's plan
--   cache found the generic plan's estimate dearer than a custom plan and planned the query again at every call
--   (about 0.3 ms of its 0.45 ms). It now keeps the generic plan: planned once per connection, the same rows.
-- * store_answer keeps an answer that only serves later repeats: its commit need not wait for the WAL flush (nor for
--   a synchronous standby). A crash, or a fail-over, that loses it costs a later repeat a new charge: an over-count,
--   never an under-count. It does so only in a transaction that wrote nothing before it (the proxy stores in one of
--   its own), so a charge made earlier in the same transaction keeps its durable commit; a charge made after it in
--   the same transaction sets synchronous_commit back on (0031).

alter function anonproxy.data_version(text[]) set plan_cache_mode = force_generic_plan;

create or replace function anonproxy.store_answer(role_name name, fingerprint text, data_version text, answer bytea)
returns bytea
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    kept bytea;
begin
    perform anonproxy.check_ledger_caller('store answers');
    if role_name is null or fingerprint is null or answer is null then
        raise exception using errcode = '22004', message = 'role_name, fingerprint and answer must not be null';
    end if;
    if fingerprint = '' or pg_catalog.octet_length(fingerprint) > 512 then
        raise exception using errcode = '22023',
            message = format('fingerprint must have 1 to 512 bytes, got %s', pg_catalog.octet_length(fingerprint)),
            hint = 'pass a hash of the canonical query';
    end if;
    if data_version is null then
        return answer;
    end if;
    -- Nothing written before it in this transaction: its commit may return before the flush (see above).
    if pg_catalog.pg_current_xact_id_if_assigned() is null then
        perform pg_catalog.set_config('synchronous_commit', 'off', true);
    end if;
    insert into anonproxy.answer_cache as c (role_name, fingerprint, data_version, answer)
        values (role_name, fingerprint, data_version, answer)
        on conflict on constraint answer_cache_pkey do nothing
        returning c.answer into kept;
    if not found then  -- kept by a transaction that committed first; this statement's snapshot sees it
        select c.answer into kept from anonproxy.answer_cache c
         where c.role_name = store_answer.role_name and c.fingerprint = store_answer.fingerprint
           and c.data_version = store_answer.data_version;
    end if;
    return kept;
end
$$;
