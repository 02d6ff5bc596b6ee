"""`anonproxy console`: a local, read-only web page for whoever audits the proxy (docs/console.md).

Pages: the privacy budgets (per role and table, spending over time), the audit
trail (searchable, paged, with each answer's cost), flags of patterns that
deserve a look, the releases (verified and composed now) and the policy's
history. It logs in with the connection string it is given, meant for a member
of ``anonproxy_auditor`` (sql/0026_auditor.sql), and shows what that login may
read. Modules: command (the CLI), server (HTTP), queries (SQL reads), flags
(pure pattern finders), history (policy differences), pages (HTML).
"""
