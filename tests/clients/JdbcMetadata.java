import java.sql.*;
import java.util.Properties;

/**
 * pgjdbc's DatabaseMetaData and ResultSetMetaData, as DBeaver or DataGrip call them: prints "section|..." lines.
 * Arguments: host port database user password [role]; with a role, the session runs as it (the "role" setting).
 * A method or query PostgreSQL refuses prints "error|" and its SQLSTATE.
 */
public class JdbcMetadata {
    static final String[] QUERIES = {
        "SELECT * FROM public.adult WHERE 1=0",
        "SELECT sex, count(*) AS people FROM public.adult GROUP BY sex LIMIT 0",
        "select relname, relkind, relnatts from pg_catalog.pg_class where relname = 'adult'",
    };

    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        Properties props = new Properties();
        props.setProperty("user", args[3]);
        props.setProperty("password", args[4]);
        if (args.length > 5) {
            props.setProperty("options", "-c role=" + args[5]);
        }
        try (Connection conn = DriverManager.getConnection(url, props)) {
            DatabaseMetaData meta = conn.getMetaData();
            print("tables", meta.getTables(null, "public", "%", new String[] {"TABLE", "VIEW"}),
                  "TABLE_SCHEM", "TABLE_NAME", "TABLE_TYPE", "REMARKS");
            for (String table : new String[] {"adult", "visits"}) {
                print("columns", meta.getColumns(null, "public", table, "%"), "TABLE_NAME", "COLUMN_NAME",
                      "DATA_TYPE", "TYPE_NAME", "COLUMN_SIZE", "DECIMAL_DIGITS", "NULLABLE", "COLUMN_DEF",
                      "ORDINAL_POSITION", "IS_NULLABLE", "IS_AUTOINCREMENT", "IS_GENERATEDCOLUMN");
                print("primary keys", meta.getPrimaryKeys(null, "public", table), "TABLE_NAME", "COLUMN_NAME",
                      "KEY_SEQ", "PK_NAME");
                print("indexes", meta.getIndexInfo(null, "public", table, false, true), "TABLE_NAME",
                      "NON_UNIQUE", "INDEX_NAME", "TYPE", "ORDINAL_POSITION", "COLUMN_NAME", "ASC_OR_DESC");
            }
            print("imported keys", meta.getImportedKeys(null, "public", "visits"), "PKTABLE_NAME",
                  "PKCOLUMN_NAME", "FKTABLE_NAME", "FKCOLUMN_NAME", "KEY_SEQ", "UPDATE_RULE", "DELETE_RULE",
                  "FK_NAME");
            print("schemas", meta.getSchemas(null, "%"), "TABLE_SCHEM");
            print("catalogs", meta.getCatalogs(), "TABLE_CAT");
            print("type info", meta.getTypeInfo(), "TYPE_NAME", "DATA_TYPE", "PRECISION");
            for (String query : QUERIES) {
                described(conn, query);
            }
        }
    }

    static void print(String section, ResultSet rs, String... columns) throws SQLException {
        try (rs) {
            while (rs.next()) {
                StringBuilder line = new StringBuilder(section);
                for (String column : columns) {
                    line.append('|').append(rs.getString(column));
                }
                System.out.println(line);
            }
        }
    }

    /** A query's ResultSetMetaData, as pgjdbc reads it (for the table of a column, its own catalog query). */
    static void described(Connection conn, String query) {
        try (Statement st = conn.createStatement(); ResultSet rs = st.executeQuery(query)) {
            ResultSetMetaData md = rs.getMetaData();
            for (int i = 1; i <= md.getColumnCount(); i++) {
                System.out.println("result|" + query + "|" + md.getColumnLabel(i) + "|" + md.getColumnName(i) + "|"
                                   + md.getColumnTypeName(i) + "|" + md.getColumnType(i) + "|"
                                   + md.getTableName(i) + "|" + md.getSchemaName(i) + "|" + md.isNullable(i) + "|"
                                   + md.isAutoIncrement(i) + "|" + md.getPrecision(i) + "|" + md.getScale(i));
            }
            int rows = 0;
            while (rs.next()) {
                rows++;
            }
            System.out.println("rows|" + query + "|" + rows);
        } catch (SQLException e) {
            System.out.println("error|" + query + "|" + e.getSQLState());
        }
    }
}
