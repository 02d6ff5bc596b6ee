// A dp analyst through anonproxy with node-postgres; run by tests/test_dp_extended.py.
//
// Connection info from the libpq variables (PGHOST, PGPORT, PGDATABASE, PGUSER, PGPASSWORD). Everything
// observed is printed as one JSON object on stdout for the Python test to check.
'use strict';

const { Client } = require('pg');

async function main() {
  const out = { notices: [] };
  const client = new Client({ application_name: 'node-pg-dp-test' });
  client.on('notice', (notice) => out.notices.push(notice.message));
  await client.connect();
  try {
    // Parameters: the extended protocol, text results.
    const bySex = 'select sex, count(*) from adult where age > $1 group by sex';
    out.by_sex = (await client.query(bySex, [30])).rows;
    // A named prepared statement: Parse once, then Bind/Execute; the second run is the cached answer.
    const named = { name: 'dp_q', text: 'select race, avg(age) from adult where sex = $1 group by race', values: ['Female'] };
    out.named = [(await client.query(named)).rows, (await client.query(named)).rows];
    out.budget = (await client.query({ text: 'show anonproxy.budget', values: [] })).rows[0]['anonproxy.budget'];
    try {
      await client.query('select max(age) from adult where sex = $1', ['Male']);
      out.refused = null;
    } catch (err) {
      out.refused = err.code;
    }
    out.after_refusal = (await client.query('select $1::int as x', [7])).rows[0].x;
  } finally {
    await client.end();
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((err) => {
  process.stderr.write(`${err.stack}\n`);
  process.exit(1);
});
