import java.sql.*;
import java.util.Properties;

/**
 * pgjdbc's ResultSetMetaData of each query given (run through PreparedStatement: Parse, Bind, Describe, Execute),
 * one "column|..." line per column: label, name, type name, table name (pgjdbc reads it from the catalogs by the
 * table OID the RowDescription names), precision, scale, nullability. The rows are read and not printed.
 * Arguments: host port database user password query...
 */
public class JdbcDescribed {
    public static void main(String[] args) throws Exception {
        String url = "jdbc:postgresql://" + args[0] + ":" + args[1] + "/" + args[2];
        Properties props = new Properties();
        props.setProperty("user", args[3]);
        props.setProperty("password", args[4]);
        try (Connection conn = DriverManager.getConnection(url, props)) {
            for (int q = 5; q < args.length; q++) {
                try (PreparedStatement st = conn.prepareStatement(args[q]); ResultSet rs = st.executeQuery()) {
                    ResultSetMetaData md = rs.getMetaData();
                    for (int i = 1; i <= md.getColumnCount(); i++) {
                        System.out.println("column|" + args[q] + "|" + md.getColumnLabel(i) + "|"
                                           + md.getColumnName(i) + "|" + md.getColumnTypeName(i) + "|"
                                           + md.getTableName(i) + "|" + md.getPrecision(i) + "|" + md.getScale(i)
                                           + "|" + md.isNullable(i));
                    }
                    while (rs.next()) {
                    }
                }
            }
        }
    }
}
