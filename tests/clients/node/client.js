// node-postgres through anonproxy; run by tests/test_clients.py.
//
// Connection info comes from the standard libpq variables node-postgres reads itself
// (PGHOST, PGPORT, PGDATABASE, PGUSER, PGPASSWORD). Everything observed is printed as
// one JSON object on stdout; the Python test checks it against values it computes
// with a direct connection. Any unexpected failure exits non-zero.
'use strict';

const { Client } = require('pg');

async function main() {
  const out = {};
  const client = new Client({ application_name: 'node-pg-client-test' });
  await client.connect();
  try {
    // Simple query protocol (no parameters): one statement, then a multi-statement string.
    const count = await client.query('select count(*)::int as n from adult');
    out.simple_count = count.rows[0].n;
    const multi = await client.query(
      'create table node_multi(x int); insert into node_multi values (1), (2), (3); select sum(x)::int as s from node_multi');
    out.multi = multi.map((result) => ({ command: result.command, rowCount: result.rowCount, rows: result.rows }));

    // Extended protocol: parameters, text results parsed by pg-types.
    const params = await client.query(
      'select id, age, workclass, fnlwgt, education from adult where age = $1 and sex = $2 order by id limit 5',
      [45, 'Female']);
    out.param_rows = params.rows;
    out.param_fields = params.fields.map((f) => f.name);

    // A named prepared statement: Parse is sent once, then only Bind/Execute.
    out.named = {};
    for (const education of ['Bachelors', 'HS-grad', 'Masters', 'Doctorate', 'Bachelors', 'HS-grad']) {
      const result = await client.query({
        name: 'q',
        text: 'select count(*)::int as n, sum(fnlwgt)::text as total from adult where education = $1',
        values: [education],
      });
      out.named[education] = out.named[education] || [];
      out.named[education].push(result.rows[0]);
    }
    const prepared = await client.query(
      "select name, statement from pg_prepared_statements where name = 'q'");
    out.prepared_statements = prepared.rows;

    // Transactions: one rolled back, one committed.
    await client.query('create table node_tx(id int primary key, note text)');
    await client.query('begin');
    await client.query('insert into node_tx values ($1, $2)', [1, 'rolled back']);
    await client.query('rollback');
    await client.query('begin');
    for (let i = 10; i < 15; i++) {
      await client.query('insert into node_tx values ($1, $2)', [i, `committed ${i}`]);
    }
    await client.query('commit');

    // Errors leave the connection usable: simple protocol, then extended protocol.
    try {
      await client.query('select * from no_such_table');
      out.simple_error = null;
    } catch (err) {
      out.simple_error = { code: err.code, message: err.message, severity: err.severity };
    }
    out.after_simple_error = (await client.query('select 1 + 1 as two')).rows[0].two;
    try {
      await client.query('select $1::int as n', ['not a number']);
      out.extended_error = null;
    } catch (err) {
      out.extended_error = { code: err.code, message: err.message };
    }
    out.after_extended_error = (await client.query('select $1::int * 2 as n', [21])).rows[0].n;
    // An error inside a transaction aborts it until ROLLBACK.
    await client.query('begin');
    try {
      await client.query('select 1/0');
    } catch (err) {
      out.tx_error = err.code;
    }
    try {
      await client.query('select 1');
      out.aborted_tx = null;
    } catch (err) {
      out.aborted_tx = err.code;
    }
    await client.query('rollback');
    out.named_after_errors = (await client.query({
      name: 'q',
      text: 'select count(*)::int as n, sum(fnlwgt)::text as total from adult where education = $1',
      values: ['Doctorate'],
    })).rows[0];
  } finally {
    await client.end();
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((err) => {
  process.stderr.write(`node client failed: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
