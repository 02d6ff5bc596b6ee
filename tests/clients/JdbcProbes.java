import java.sql.*;

/** pgjdbc metadata and privilege probes as the reporter through the gated proxy: prints "label|..." lines. */
public class JdbcProbes {
    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        try (Connection conn = DriverManager.getConnection(url, "reporter", "reporter")) {
            DatabaseMetaData meta = conn.getMetaData();
            try (ResultSet rs = meta.getTables(null, "public", "adult", new String[] {"TABLE"})) {
                while (rs.next()) {
                    System.out.println("table|" + rs.getString("TABLE_SCHEM") + "|" + rs.getString("TABLE_NAME"));
                }
            }
            try (ResultSet rs = meta.getTablePrivileges(null, "public", "adult")) {
                while (rs.next()) {
                    System.out.println("privilege|" + rs.getString("GRANTEE") + "|" + rs.getString("PRIVILEGE"));
                }
            }
            try (ResultSet rs = meta.getColumnPrivileges(null, "public", "adult", "age")) {
                while (rs.next()) {
                    System.out.println("column|" + rs.getString("GRANTEE") + "|" + rs.getString("PRIVILEGE"));
                }
            }
            try (Statement st = conn.createStatement();
                 ResultSet rs = st.executeQuery("select has_table_privilege('public.adult', 'SELECT')")) {
                rs.next();
                System.out.println("probe|" + rs.getBoolean(1));
            }
            // More than 5 executions: pgjdbc switches to a named server-side statement.
            String sql = "select pg_catalog.has_table_privilege(?, 'SELECT'), has_table_privilege(?, 'INSERT')";
            try (PreparedStatement st = conn.prepareStatement(sql)) {
                for (int round = 0; round < 7; round++) {
                    st.setString(1, "public.adult");
                    st.setString(2, "public.adult");
                    try (ResultSet rs = st.executeQuery()) {
                        rs.next();
                        System.out.println("prepared|" + rs.getBoolean(1) + "|" + rs.getBoolean(2));
                    }
                }
            }
        }
    }
}
