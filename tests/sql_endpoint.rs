//! The SQL endpoint of `gpuwarden pipeline` as analysts and Grafana use it: the real psql
//! over TCP, password authentication, a read-only session, files written after the start
//! visible to the next query, the queries Grafana's PostgreSQL data source sends, and those
//! JDBC tools (pgjdbc's DatabaseMetaData, Metabase, DBeaver) send to discover the tables.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::psql::{error_fields, RawClient};
use support::s3::S3Server;
use support::{
    eventually, ingest_samples, sql_threads_busy, start_pipeline_with_sql, until_sql_threads_busy,
    Psql, Running,
};

/// 2026-11-30T10:00:00Z.
const T0: i64 = 1_796_032_800_000;
const USER: &str = "finops";
const PASSWORD: &str = "correct horse";

/// `n` samples for each of 8 GPUs, one a minute from `T0 + from_minute`; GPU g runs at g × 10 %.
fn samples(from_minute: i64, n: i64) -> String {
    let mut lines = String::new();
    for minute in from_minute..from_minute + n {
        for gpu in 0..8 {
            lines.push_str(
                &serde_json::json!({
                    "v": 1, "ts_ms": T0 + minute * 60_000, "interval_ms": 60_000,
                    "host": "node-0", "gpu_uuid": format!("GPU-{gpu}"),
                    "gpu_model": "NVIDIA H100 80GB HBM3", "util_gpu_pct": (gpu * 10) as f64,
                    "mem_used_bytes": 1u64 << 30, "mem_total_bytes": 85_899_345_920u64
                })
                .to_string(),
            );
            lines.push('\n');
        }
    }
    lines
}

/// A pipeline on the embedded broker, serving SQL on a free port.
struct Endpoint {
    config: PathBuf,
    pipeline: Running,
    port: u16,
    /// The S3 server of a lake in a bucket; dropped after the pipeline.
    _server: Option<S3Server>,
    dir: tempfile::TempDir,
}

impl Endpoint {
    fn start(pipeline_section: &str) -> Self {
        Self::start_on(pipeline_section, false)
    }

    /// [`Endpoint::start`] with the lake in a bucket of an S3 server of its own when `bucket`.
    fn start_on(pipeline_section: &str, bucket: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("gpuwarden.toml");
        let server = bucket.then(|| S3Server::start(&dir.path().join("s3"), "lake"));
        let data = dir.path().join("data");
        let storage = match &server {
            Some(server) => server.storage_config(&data, "sql"),
            None => format!("[storage]\ndata_dir = \"{}\"\n", data.display()),
        };
        std::fs::write(
            &config,
            format!(
                "[kafka]\nbrokers = \"embedded\"\n\n{storage}\n[pipeline]\nflush_age = \"300ms\"\n{pipeline_section}\n"
            ),
        )
        .unwrap();
        ingest_samples(&config, &dir.path().join("first.jsonl"), &samples(0, 90));
        let (pipeline, port) = start_pipeline_with_sql(&config);
        Self {
            config,
            pipeline,
            port,
            _server: server,
            dir,
        }
    }

    fn with_users() -> Self {
        Self::with_users_on(false)
    }

    fn with_users_on(bucket: bool) -> Self {
        Self::start_on(
            &format!("[[pipeline.sql_users]]\nname = \"{USER}\"\npassword = \"{PASSWORD}\"\n"),
            bucket,
        )
    }

    /// psql as `user`.
    fn psql(&self, user: &str, password: Option<&str>) -> Psql {
        Psql::new(self.port, user, password)
    }

    /// The rows of a query that must succeed, as `a|b` lines.
    #[track_caller]
    fn query(&self, sql: &str) -> Vec<String> {
        self.psql(USER, Some(PASSWORD)).rows(sql)
    }

    #[track_caller]
    fn one(&self, sql: &str) -> String {
        self.psql(USER, Some(PASSWORD)).one(sql)
    }
}

#[test]
fn psql_reads_the_lake_and_sees_files_written_after_the_start() {
    reads_the_lake_and_files_written_after_the_start(Endpoint::with_users());
}

/// The same with the lake in an S3 bucket (docs/src/contributors/object-storage.md).
#[test]
fn psql_reads_a_lake_in_a_bucket_and_sees_files_written_after_the_start() {
    reads_the_lake_and_files_written_after_the_start(Endpoint::with_users_on(true));
}

fn reads_the_lake_and_files_written_after_the_start(endpoint: Endpoint) {
    // 8 GPUs x 90 minutes; GPU g at g x 10 %: 90 x (0 + 10 + ... + 70) = 25,200.
    assert_eq!(
        endpoint.one("SELECT count(*), sum(util_gpu_pct), count(DISTINCT gpu_uuid) FROM samples"),
        "720|25200.0|8"
    );
    assert_eq!(
        endpoint.query(
            "SELECT date_trunc('hour', to_timestamp_millis(ts_ms)) AS hour, count(*) \
             FROM samples GROUP BY 1 ORDER BY 1"
        ),
        [
            "2026-11-30 10:00:00.000000|480",
            "2026-11-30 11:00:00.000000|240"
        ]
    );
    // Every table of docs/src/contributors/pipeline.md#sql-tables is there, empty ones included.
    assert_eq!(endpoint.one("SELECT count(*) FROM lease_events"), "0");

    // Another 30 minutes, ingested while the pipeline runs: the next query sees them.
    ingest_samples(
        &endpoint.config,
        &endpoint.dir.path().join("more.jsonl"),
        &samples(90, 30),
    );
    assert_eq!(
        endpoint.one("SELECT count(*), max(ts_ms) FROM samples"),
        format!("960|{}", T0 + 119 * 60_000)
    );

    let (status, log) = endpoint.pipeline.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
}

#[test]
fn wrong_passwords_unknown_users_and_anonymous_clients_are_refused() {
    let endpoint = Endpoint::with_users();
    let refused = |user: &str, password: Option<&str>| {
        let out = endpoint.psql(user, password).run("SELECT 1");
        assert!(!out.status.success(), "{user} got in");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let wrong = refused(USER, Some("incorrect horse"));
    assert!(
        wrong.contains(&format!(
            "password authentication failed for user \"{USER}\""
        )),
        "{wrong}"
    );
    let unknown = refused("mallory", Some(PASSWORD));
    assert!(
        unknown.contains("password authentication failed for user \"mallory\""),
        "{unknown}"
    );
    // No password at all: the server asks for one (anonymous access is off by default).
    let anonymous = refused("mallory", None);
    assert!(anonymous.contains("no password supplied"), "{anonymous}");
    let without_password = refused(USER, None);
    assert!(
        without_password.contains("no password supplied"),
        "{without_password}"
    );
    assert_eq!(endpoint.one("SELECT current_user IS NOT NULL"), "t");

    // With anonymous access on, anyone gets in without a password, but a configured user still
    // needs theirs.
    let open = Endpoint::start(&format!(
        "sql_allow_anonymous = true\n[[pipeline.sql_users]]\nname = \"{USER}\"\npassword = \"{PASSWORD}\"\n"
    ));
    let out = open
        .psql("grafana", None)
        .run("SELECT count(*) FROM samples");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "720");
    let out = open.psql(USER, Some("incorrect horse")).run("SELECT 1");
    assert!(!out.status.success());

    // Nobody could log in: asking for the endpoint anyway is an error that says what to add.
    let config = endpoint.dir.path().join("no-users.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbrokers = \"embedded\"\n[storage]\ndata_dir = \"{}\"\n",
            endpoint.dir.path().join("other").display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
        .args(["pipeline", "--config", config.to_str().unwrap()])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--sql-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[[pipeline.sql_users]]"), "{stderr}");
}

#[test]
fn writes_are_refused_and_the_connection_stays_usable() {
    let endpoint = Endpoint::with_users();
    let script = "\
        CREATE TABLE t (a INT);\n\
        CREATE VIEW v AS SELECT 1;\n\
        INSERT INTO samples (ts_ms) VALUES (1);\n\
        UPDATE samples SET host = 'x';\n\
        DELETE FROM samples;\n\
        DROP TABLE samples;\n\
        COPY samples TO '/tmp/gpuwarden-sql-endpoint-copy.csv';\n\
        SELECT 1 AS a INTO copied;\n\
        SET datafusion.execution.batch_size = 1;\n\
        SELECT count(*) FROM samples;\n";
    let out = endpoint.psql(USER, Some(PASSWORD)).script(script);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for what in [
        "CREATE TABLE",
        "CREATE VIEW",
        "INSERT",
        "UPDATE",
        "DELETE",
        "DROP TABLE",
        "COPY",
        "a query that writes (DDL not supported: CreateMemoryTable)",
        "SET datafusion.execution.batch_size",
    ] {
        assert!(
            stderr.contains(&format!(
                "ERROR:  cannot execute {what}: the gpuwarden SQL endpoint is read-only"
            )),
            "{what}:\n{stderr}"
        );
    }
    // The same connection then answers a query, over a lake nobody changed.
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "720");
    assert!(!Path::new("/tmp/gpuwarden-sql-endpoint-copy.csv").exists());
    assert_eq!(
        endpoint.one("SELECT count(*) FROM information_schema.tables WHERE table_name IN ('t', 'v', 'copied')"),
        "0"
    );

    // What clients send when they connect or hand a connection back is accepted.
    let out = endpoint.psql(USER, Some(PASSWORD)).script(
        "SET application_name = 'grafana';\nSET extra_float_digits = 3;\nSET TIME ZONE 'UTC';\n\
         BEGIN;\nSELECT 1;\nCOMMIT;\nROLLBACK;\nDISCARD ALL;\nSHOW TIME ZONE;\nSELECT 2;\n",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("ERROR"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.trim_end().ends_with('2'), "{stdout}");
}

// The SQL Grafana's PostgreSQL data source sends, as it sends it: the connection check (pgx's
// ping), the version and TimescaleDB probes of the data source settings page, and the schema,
// table and column discovery of the query builder (postgresMetaQuery.ts).
const GRAFANA_PING: &str = "-- ping";
const GRAFANA_VERSION: &str = "SELECT current_setting('server_version_num')::int/100 as version";
const GRAFANA_TIMESCALEDB: &str =
    "SELECT extversion FROM pg_extension WHERE extname = 'timescaledb'";
const GRAFANA_SCHEMAS: &str = r#"SELECT schema_name AS "name"
    FROM information_schema.schemata
    WHERE schema_name NOT IN ('information_schema',
                              'pg_catalog',
                              'pg_toast',
                              '_timescaledb_cache',
                              '_timescaledb_catalog',
                              '_timescaledb_internal',
                              '_timescaledb_config',
                              'timescaledb_information',
                              'timescaledb_experimental')
    ORDER BY schema_name"#;
const GRAFANA_SCHEMA_CONSTRAINT: &str = r#"
          quote_ident(table_schema) IN (
          SELECT
            CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END
          FROM
            generate_series(
              array_lower(string_to_array(current_setting('search_path'),','),1),
              array_upper(string_to_array(current_setting('search_path'),','),1)
            ) as i,
            string_to_array(current_setting('search_path'),',') s
          )"#;

fn grafana_tables() -> String {
    let c = GRAFANA_SCHEMA_CONSTRAINT;
    format!(
        r#"SELECT
    CASE WHEN {c}
      THEN quote_ident(table_name)
      ELSE quote_ident(table_schema) || '.' || quote_ident(table_name)
    END AS "table"
    FROM information_schema.tables
    WHERE quote_ident(table_schema) NOT IN ('information_schema',
                             'pg_catalog',
                             '_timescaledb_cache',
                             '_timescaledb_catalog',
                             '_timescaledb_internal',
                             '_timescaledb_config',
                             'timescaledb_information',
                             'timescaledb_experimental')
    ORDER BY CASE WHEN {c} THEN 0 ELSE 1 END, 1"#
    )
}

fn grafana_tables_in(schema: &str) -> String {
    format!(
        r#"SELECT quote_ident(table_name) AS "table"
      FROM information_schema.tables
      WHERE quote_ident(table_schema) = '{schema}'
      ORDER BY 1"#
    )
}

fn grafana_columns(table: &str) -> String {
    let c = GRAFANA_SCHEMA_CONSTRAINT;
    format!(
        r#"SELECT quote_ident(column_name) AS "column", data_type AS "type"
    FROM information_schema.columns
    WHERE
      CASE WHEN array_length(parse_ident('{table}'),1) = 2
        THEN quote_ident(table_schema) = (parse_ident('{table}'))[1]
          AND quote_ident(table_name) = (parse_ident('{table}'))[2]
        ELSE quote_ident(table_name) = '{table}'
          AND {c}
      END"#
    )
}

#[test]
fn grafana_connection_check_discovery_and_macro_queries_answer() {
    let endpoint = Endpoint::with_users();
    assert!(endpoint.query(GRAFANA_PING).is_empty());
    assert_eq!(endpoint.one(GRAFANA_VERSION), "1600");
    assert!(
        endpoint.query(GRAFANA_TIMESCALEDB).is_empty(),
        "no TimescaleDB"
    );
    assert!(endpoint
        .query(GRAFANA_SCHEMAS)
        .contains(&"public".to_string()));

    let tables = endpoint.query(&grafana_tables());
    for table in [
        "samples",
        "lease_events",
        "signals",
        "actions",
        "quarantine",
    ] {
        assert!(
            tables
                .iter()
                .any(|t| t == table || *t == format!("public.{table}")),
            "{table} in {tables:?}"
        );
    }
    assert!(
        !tables
            .iter()
            .any(|t| t.contains("pg_catalog") || t.contains("information_schema")),
        "{tables:?}"
    );
    let in_public = endpoint.query(&grafana_tables_in("public"));
    assert!(in_public.contains(&"samples".to_string()), "{in_public:?}");

    // The builder asks for the columns of the name the table list gave, and picks each one's
    // kind (number, text, time) from its Postgres type name (sqlUtil.ts's getFieldConfig).
    let listed = tables.iter().find(|t| t.ends_with("samples")).unwrap();
    let columns = endpoint.query(&grafana_columns(listed));
    for column in [
        "ts_ms|bigint",
        "gpu_uuid|text",
        "util_gpu_pct|double precision",
    ] {
        assert!(
            columns.iter().any(|c| c == column),
            "{column} in {columns:?}"
        );
    }
    assert_eq!(columns.len(), sample_columns(), "{columns:?}");
    // datafusion-postgres 0.19 replaces the search_path subquery of these queries with '' (a
    // token-level blacklist in its parser), so the list names every table with its schema
    // (`public.team_hourly`), and only such a name finds its columns.
    let listed = tables.iter().find(|t| t.ends_with("team_hourly")).unwrap();
    let columns = endpoint.query(&grafana_columns(listed));
    for column in [
        "hour|timestamp with time zone",
        "team|text",
        "cost_usd|double precision",
        "final|boolean",
    ] {
        assert!(
            columns.iter().any(|c| c == column),
            "{column} in {columns:?}"
        );
    }

    // Panel queries as Grafana sends them once its macros are expanded, over a timestamp
    // column: the raw tables keep epoch milliseconds, the rollup tables have
    // `hour TIMESTAMP(ms, UTC)`; `s` and `h` stand for them here.
    let from = "'2026-11-30T00:00:00Z'";
    let to = "'2026-12-01T00:00:00Z'";
    let s = "(SELECT to_timestamp_millis(ts_ms) AS ts, gpu_uuid, util_gpu_pct FROM samples) s";
    let h = "(SELECT date_trunc('hour', arrow_cast(to_timestamp_millis(ts_ms), 'Timestamp(ms, \"UTC\")')) \
             AS hour, sum(util_gpu_pct) AS util FROM samples GROUP BY 1) h";
    // $__time(ts), $__timeFilter(ts)
    let rows = endpoint.query(&format!(
        r#"SELECT ts AS "time", gpu_uuid AS metric, util_gpu_pct FROM {s} WHERE ts BETWEEN {from} AND {to} ORDER BY 1, 2"#
    ));
    assert_eq!(rows.len(), 720);
    assert_eq!(rows[0], "2026-11-30 10:00:00.000000|GPU-0|0");
    // $__timeEpoch(ts), $__timeFrom(), $__timeTo()
    let rows = endpoint.query(&format!(
        r#"SELECT extract(epoch from ts) as "time", util_gpu_pct FROM {s} WHERE ts >= {from} AND ts <= {to} ORDER BY 1, 2 LIMIT 1"#
    ));
    assert_eq!(rows, ["1796032800.0|0"]);
    // $__timeGroupAlias(ts, 5m): 90 minutes of data, 18 buckets.
    let rows = endpoint.query(&format!(
        r#"SELECT floor(extract(epoch from ts)/300)*300 AS "time", avg(util_gpu_pct) AS util FROM {s} WHERE ts BETWEEN {from} AND {to} GROUP BY 1 ORDER BY 1"#
    ));
    assert_eq!(rows.len(), 18, "{rows:?}");
    assert_eq!(rows[0], "1796032800.0|35.0");
    // On a TIMESTAMP(ms, UTC) hour column: $__timeFilter, $__timeEpoch, $__timeGroup turned
    // back into a timestamp with to_timestamp, and date_trunc.
    let rows = endpoint.query(&format!(
        r#"SELECT hour AS "time", extract(epoch from hour) AS epoch, to_timestamp(floor(extract(epoch from hour)/300)*300) AS bucket, date_trunc('hour', hour) AS truncated, util FROM {h} WHERE hour BETWEEN {from} AND {to} ORDER BY 1"#
    ));
    assert_eq!(
        rows,
        [
            "2026-11-30 10:00:00.000000+00|1796032800.0|2026-11-30 10:00:00.000000|2026-11-30 10:00:00.000000+00|16800.0",
            "2026-11-30 11:00:00.000000+00|1796036400.0|2026-11-30 11:00:00.000000|2026-11-30 11:00:00.000000+00|8400.0",
        ]
    );
    // $__unixEpochFilter(ts_ms/1000), $__unixEpochGroupAlias(ts_ms/1000, 1h)
    let rows = endpoint.query(
        r#"SELECT floor((ts_ms/1000)/3600)*3600 AS "time", count(*) FROM samples WHERE ts_ms/1000 >= 1795996800 AND ts_ms/1000 <= 1796083200 GROUP BY 1 ORDER BY 1"#,
    );
    assert_eq!(rows, ["1796032800.0|480", "1796036400.0|240"]);
}

// What JDBC tools (DBeaver, Metabase, IntelliJ, Tableau…) send to list schemas, tables and
// columns: pgjdbc 42.7's PgDatabaseMetaData, getSchemas(), getTables(null, "public", "%",
// {"TABLE", "VIEW"}) and getColumns(null, "public", "samples", "%"). pgjdbc binds the patterns
// as parameters (`LIKE ?`); psql 15 cannot bind, so they are written in as literals.
const PGJDBC_SCHEMAS: &str = r#"SELECT nspname AS "TABLE_SCHEM", current_database() AS "TABLE_CATALOG" FROM pg_catalog.pg_namespace  WHERE nspname <> 'pg_toast' AND (nspname !~ '^pg_temp_'  OR nspname = (pg_catalog.current_schemas(true))[1]) AND (nspname !~ '^pg_toast_temp_'  OR nspname = replace((pg_catalog.current_schemas(true))[1], 'pg_temp_', 'pg_toast_temp_'))  ORDER BY "TABLE_SCHEM""#;
const PGJDBC_TABLES: &str = r#"SELECT current_database() AS "TABLE_CAT", n.nspname AS "TABLE_SCHEM", c.relname AS "TABLE_NAME",  CASE n.nspname ~ '^pg_' OR n.nspname = 'information_schema'  WHEN true THEN CASE  WHEN n.nspname = 'pg_catalog' OR n.nspname = 'information_schema' THEN CASE c.relkind   WHEN 'r' THEN 'SYSTEM TABLE'   WHEN 'v' THEN 'SYSTEM VIEW'   WHEN 'i' THEN 'SYSTEM INDEX'   ELSE NULL   END  WHEN n.nspname = 'pg_toast' THEN CASE c.relkind   WHEN 'r' THEN 'SYSTEM TOAST TABLE'   WHEN 'i' THEN 'SYSTEM TOAST INDEX'   ELSE NULL   END  ELSE CASE c.relkind   WHEN 'r' THEN 'TEMPORARY TABLE'   WHEN 'p' THEN 'TEMPORARY TABLE'   WHEN 'i' THEN 'TEMPORARY INDEX'   WHEN 'S' THEN 'TEMPORARY SEQUENCE'   WHEN 'v' THEN 'TEMPORARY VIEW'   ELSE NULL   END  END  WHEN false THEN CASE c.relkind  WHEN 'r' THEN 'TABLE'  WHEN 'p' THEN 'PARTITIONED TABLE'  WHEN 'i' THEN 'INDEX'  WHEN 'P' then 'PARTITIONED INDEX'  WHEN 'S' THEN 'SEQUENCE'  WHEN 'v' THEN 'VIEW'  WHEN 'c' THEN 'TYPE'  WHEN 'f' THEN 'FOREIGN TABLE'  WHEN 'm' THEN 'MATERIALIZED VIEW'  ELSE NULL  END  ELSE NULL  END  AS "TABLE_TYPE", d.description AS "REMARKS",  '' as "TYPE_CAT", '' as "TYPE_SCHEM", '' as "TYPE_NAME", '' AS "SELF_REFERENCING_COL_NAME", '' AS "REF_GENERATION"  FROM pg_catalog.pg_namespace n, pg_catalog.pg_class c  LEFT JOIN pg_catalog.pg_description d ON (c.oid = d.objoid AND d.objsubid = 0  and d.classoid = 'pg_class'::regclass)  WHERE c.relnamespace = n.oid  AND n.nspname LIKE 'public' AND c.relname LIKE '%' AND (false  OR ( c.relkind = 'r' AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema' )  OR ( c.relkind = 'v' AND n.nspname <> 'pg_catalog' AND n.nspname <> 'information_schema' ) )  ORDER BY "TABLE_TYPE","TABLE_SCHEM","TABLE_NAME" "#;
const PGJDBC_COLUMNS: &str = r#"SELECT * FROM (SELECT current_database() AS current_database, n.nspname,c.relname,a.attname,a.atttypid,a.attnotnull  OR (t.typtype = 'd' AND t.typnotnull) AS attnotnull,a.atttypmod,a.attlen,t.typtypmod,row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum) AS attnum, nullif(a.attidentity, '') as attidentity,nullif(a.attgenerated, '') as attgenerated,pg_catalog.pg_get_expr(def.adbin, def.adrelid) AS adsrc,dsc.description,t.typbasetype,t.typtype  FROM pg_catalog.pg_namespace n  JOIN pg_catalog.pg_class c ON (c.relnamespace = n.oid)  JOIN pg_catalog.pg_attribute a ON (a.attrelid=c.oid)  JOIN pg_catalog.pg_type t ON (a.atttypid = t.oid)  LEFT JOIN pg_catalog.pg_attrdef def ON (a.attrelid=def.adrelid AND a.attnum = def.adnum)  LEFT JOIN pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND a.attnum = dsc.objsubid)  LEFT JOIN pg_catalog.pg_class dc ON (dc.oid=dsc.classoid AND dc.relname='pg_class')  LEFT JOIN pg_catalog.pg_namespace dn ON (dc.relnamespace=dn.oid AND dn.nspname='pg_catalog')  WHERE c.relkind in ('r','p','v','f','m') and a.attnum > 0 AND NOT a.attisdropped  AND n.nspname LIKE 'public' AND c.relname LIKE 'samples') c WHERE true  AND attname LIKE '%' ORDER BY nspname,c.relname,attnum "#;

// Metabase's sync (src/metabase/driver/postgres.clj, v0.5x): describe-database's tables
// (get-tables-sql for the schemas to sync, with the current user's table privileges), and
// describe-fields-sql for a table, as HoneySQL writes them with their parameters inlined.
const METABASE_TABLES: &str = r#"SELECT "n"."nspname" AS "schema", "c"."relname" AS "name", CASE "c"."relkind" WHEN 'r' THEN 'TABLE' WHEN 'p' THEN 'PARTITIONED TABLE' WHEN 'v' THEN 'VIEW' WHEN 'f' THEN 'FOREIGN TABLE' WHEN 'm' THEN 'MATERIALIZED VIEW' ELSE NULL END AS "type", "d"."description" AS "description", "stat"."n_live_tup" AS "estimated_row_count" FROM "pg_catalog"."pg_class" AS "c" INNER JOIN "pg_catalog"."pg_namespace" AS "n" ON "c"."relnamespace" = "n"."oid" LEFT JOIN "pg_catalog"."pg_description" AS "d" ON ("c"."oid" = "d"."objoid") AND ("d"."objsubid" = 0) AND ("d"."classoid" = 'pg_class'::regclass) LEFT JOIN "pg_stat_user_tables" AS "stat" ON ("n"."nspname" = "stat"."schemaname") AND ("c"."relname" = "stat"."relname") WHERE ("c"."relnamespace" = "n"."oid") AND ("n"."nspname" !~ '^pg_') AND ("n"."nspname" <> 'information_schema') AND c.relkind in ('r', 'p', 'v', 'f', 'm') AND ("n"."nspname" IN ('public')) ORDER BY "type" ASC, "schema" ASC, "name" ASC"#;
const METABASE_PRIVILEGES: &str = r#"with table_privileges as (
 select
   NULL as role,
   t.schemaname as schema,
   t.objectname as table,
   pg_catalog.has_any_column_privilege(current_user, '"' || replace(t.schemaname, '"', '""') || '"' || '.' || '"' || replace(t.objectname, '"', '""') || '"',  'update') as update,
   pg_catalog.has_any_column_privilege(current_user, '"' || replace(t.schemaname, '"', '""') || '"' || '.' || '"' || replace(t.objectname, '"', '""') || '"',  'select') as select,
   pg_catalog.has_any_column_privilege(current_user, '"' || replace(t.schemaname, '"', '""') || '"' || '.' || '"' || replace(t.objectname, '"', '""') || '"',  'insert') as insert,
   pg_catalog.has_table_privilege(     current_user, '"' || replace(t.schemaname, '"', '""') || '"' || '.' || '"' || replace(t.objectname, '"', '""') || '"',  'delete') as delete
 from (
   select schemaname, tablename as objectname from pg_catalog.pg_tables
   union
   select schemaname, viewname as objectname from pg_catalog.pg_views
   union
   select schemaname, matviewname as objectname from pg_catalog.pg_matviews
 ) t
 where t.schemaname !~ '^pg_'
   and t.schemaname <> 'information_schema'
   and pg_catalog.has_schema_privilege(current_user, t.schemaname, 'usage')
)
select t.*
from table_privileges t"#;
const METABASE_FIELDS: &str = r#"SELECT "c"."column_name" AS "name", CASE WHEN "c"."udt_schema" IN ('public', 'pg_catalog') THEN FORMAT('%s', "c"."udt_name") ELSE FORMAT('"%s"."%s"', "c"."udt_schema", "c"."udt_name") END AS "database-type", "c"."ordinal_position" - 1 AS "database-position", "c"."table_schema" AS "table-schema", "c"."table_name" AS "table-name", "pk"."column_name" IS NOT NULL AS "pk?", COL_DESCRIPTION(CAST(CAST(FORMAT('%I.%I', CAST("c"."table_schema" AS TEXT), CAST("c"."table_name" AS TEXT)) AS REGCLASS) AS OID), "c"."ordinal_position") AS "field-comment", (("column_default" IS NULL) OR (LOWER("column_default") = 'null')) AND ("is_nullable" = 'NO') AND NOT ((("column_default" IS NOT NULL) AND ("column_default" LIKE '%nextval(%')) OR ("is_identity" <> 'NO')) AS "database-required", (("column_default" IS NOT NULL) AND ("column_default" LIKE '%nextval(%')) OR ("is_identity" <> 'NO') AS "database-is-auto-increment" FROM "information_schema"."columns" AS "c" LEFT JOIN (SELECT "tc"."table_schema", "tc"."table_name", "kc"."column_name" FROM "information_schema"."table_constraints" AS "tc" INNER JOIN "information_schema"."key_column_usage" AS "kc" ON ("tc"."constraint_name" = "kc"."constraint_name") AND ("tc"."table_schema" = "kc"."table_schema") AND ("tc"."table_name" = "kc"."table_name") WHERE "tc"."constraint_type" = 'PRIMARY KEY') AS "pk" ON ("c"."table_schema" = "pk"."table_schema") AND ("c"."table_name" = "pk"."table_name") AND ("c"."column_name" = "pk"."column_name") WHERE c.table_schema !~ '^information_schema|catalog_history|pg_' AND ("c"."table_schema" IN ('public')) AND ("c"."table_name" IN ('team_hourly')) UNION ALL SELECT "pa"."attname" AS "name", CASE WHEN "ptn"."nspname" IN ('public', 'pg_catalog') THEN FORMAT('%s', "pt"."typname") ELSE FORMAT('"%s"."%s"', "ptn"."nspname", "pt"."typname") END AS "database-type", "pa"."attnum" - 1 AS "database-position", "pn"."nspname" AS "table-schema", "pc"."relname" AS "table-name", FALSE AS "pk?", NULL AS "field-comment", FALSE AS "database-required", FALSE AS "database-is-auto-increment" FROM "pg_catalog"."pg_class" AS "pc" INNER JOIN "pg_catalog"."pg_namespace" AS "pn" ON "pn"."oid" = "pc"."relnamespace" INNER JOIN "pg_catalog"."pg_attribute" AS "pa" ON "pa"."attrelid" = "pc"."oid" INNER JOIN "pg_catalog"."pg_type" AS "pt" ON "pt"."oid" = "pa"."atttypid" INNER JOIN "pg_catalog"."pg_namespace" AS "ptn" ON "ptn"."oid" = "pt"."typnamespace" WHERE ("pc"."relkind" = 'm') AND ("pa"."attnum" >= 1) AND ("pn"."nspname" IN ('public')) AND ("pc"."relname" IN ('team_hourly')) ORDER BY "table-schema" ASC, "table-name" ASC, "database-position" ASC"#;

// DBeaver's PostgreSQL plugin (plugins/org.jkiss.dbeaver.ext.postgresql, model/PostgreDatabase
// and PostgreSchema): the database, its schemas, a schema's tables and a table's columns, with
// the name and oids it binds written in.
const DBEAVER_DATABASE: &str =
    "SELECT db.oid,db.* FROM pg_catalog.pg_database db WHERE datname='gpuwarden'";
const DBEAVER_SCHEMAS: &str = "SELECT n.oid,n.*,d.description FROM pg_catalog.pg_namespace n\n\
    LEFT OUTER JOIN pg_catalog.pg_description d ON d.objoid=n.oid AND d.objsubid=0 AND d.classoid='pg_namespace'::regclass\n \
    ORDER BY nspname";

fn dbeaver_tables(schema_oid: &str) -> String {
    format!(
        "SELECT c.oid,c.*,d.description,pg_catalog.pg_get_expr(c.relpartbound, c.oid) as partition_expr,  pg_catalog.pg_get_partkeydef(c.oid) as partition_key \n\
         FROM pg_catalog.pg_class c\n\
         LEFT OUTER JOIN pg_catalog.pg_description d ON d.objoid=c.oid AND d.objsubid=0 AND d.classoid='pg_class'::regclass\n\
         WHERE c.relnamespace={schema_oid} AND c.relkind not in ('i','I','c')"
    )
}

fn dbeaver_columns(table_oid: &str) -> String {
    format!(
        "SELECT c.relname,a.*,pg_catalog.pg_get_expr(ad.adbin, ad.adrelid, true) as def_value,dsc.description,dep.objid\n\
         FROM pg_catalog.pg_attribute a\n\
         INNER JOIN pg_catalog.pg_class c ON (a.attrelid=c.oid)\n\
         LEFT OUTER JOIN pg_catalog.pg_attrdef ad ON (a.attrelid=ad.adrelid AND a.attnum = ad.adnum)\n\
         LEFT OUTER JOIN pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND a.attnum = dsc.objsubid)\n\
         LEFT OUTER JOIN pg_depend dep on dep.refobjid = a.attrelid AND dep.deptype = 'i' and dep.refobjsubid = a.attnum and dep.classid = dep.refclassid\n\
         WHERE NOT a.attisdropped AND c.relkind not in ('i','I','c') AND c.oid={table_oid}\n\
         ORDER BY a.attnum"
    )
}

/// The lake's relations in the `public` schema, as (name, kind): its tables (the config's
/// `teams` and `workloads` too) and its two views.
const LAKE_RELATIONS: [(&str, &str); 14] = [
    ("actions", "TABLE"),
    ("focus_costs", "TABLE"),
    ("gpu_hourly", "TABLE"),
    ("lease_events", "TABLE"),
    ("lease_hourly", "TABLE"),
    ("leases", "TABLE"),
    ("quarantine", "TABLE"),
    ("samples", "TABLE"),
    ("signals", "TABLE"),
    ("team_hourly", "TABLE"),
    ("teams", "TABLE"),
    ("workloads", "TABLE"),
    ("clock_skew", "VIEW"),
    ("lease_usage", "VIEW"),
];

/// The values of `columns` in each row of `answer`, joined with `|`; NULL as the empty string.
fn pick(answer: &support::Answer, columns: &[&str]) -> Vec<String> {
    let at: Vec<usize> = columns
        .iter()
        .map(|name| {
            answer
                .columns
                .iter()
                .position(|c| c == name)
                .unwrap_or_else(|| panic!("no column {name} in {:?}", answer.columns))
        })
        .collect();
    answer
        .rows
        .iter()
        .map(|row| {
            at.iter()
                .map(|&i| row[i].clone().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect()
}

#[test]
fn jdbc_metabase_and_dbeaver_discover_the_tables_and_their_columns() {
    let endpoint = Endpoint::with_users();
    let psql = endpoint.psql(USER, Some(PASSWORD));
    let answer = |sql: &str| {
        psql.answer(sql)
            .unwrap_or_else(|e| panic!("{e}\n--- for ---\n{sql}"))
    };
    let relations = |kinds: [&str; 2]| -> Vec<String> {
        LAKE_RELATIONS
            .iter()
            .map(|(name, kind)| {
                let kind = if *kind == "TABLE" { kinds[0] } else { kinds[1] };
                format!("{name}|{kind}")
            })
            .collect()
    };
    // The database clients connect to (postgres://…/gpuwarden) is the one they are told of.
    assert_eq!(endpoint.one("SELECT current_database()"), "gpuwarden");

    // pgjdbc.
    assert_eq!(
        pick(&answer(PGJDBC_SCHEMAS), &["TABLE_SCHEM", "TABLE_CATALOG"]),
        [
            "information_schema|gpuwarden",
            "pg_catalog|gpuwarden",
            "public|gpuwarden"
        ]
    );
    let tables = answer(PGJDBC_TABLES);
    assert_eq!(
        pick(&tables, &["TABLE_NAME", "TABLE_TYPE"]),
        relations(["TABLE", "VIEW"])
    );
    assert!(pick(&tables, &["TABLE_CAT", "TABLE_SCHEM"])
        .iter()
        .all(|t| t == "gpuwarden|public"));
    // Type oids: 20 int8, 25 text, 701 float8; NOT NULL as the lake's schema says.
    let columns = pick(
        &answer(PGJDBC_COLUMNS),
        &["relname", "attname", "atttypid", "attnotnull", "attnum"],
    );
    assert_eq!(columns.len(), sample_columns(), "{columns:?}");
    assert_eq!(
        columns[..7],
        [
            "samples|v|20|t|1",
            "samples|ts_ms|20|t|2",
            "samples|interval_ms|20|t|3",
            "samples|host|25|t|4",
            "samples|gpu_uuid|25|t|5",
            "samples|gpu_model|25|t|6",
            "samples|util_gpu_pct|701|t|7",
        ]
    );
    assert!(
        columns.contains(&"samples|lease_id|25|f|19".to_string()),
        "{columns:?}"
    );

    // Metabase.
    assert_eq!(
        pick(&answer(METABASE_TABLES), &["name", "type"]),
        relations(["TABLE", "VIEW"])
    );
    let mut readable = pick(&answer(METABASE_PRIVILEGES), &["schema", "table", "select"]);
    readable.sort();
    let mut expected: Vec<String> = LAKE_RELATIONS
        .iter()
        .map(|(name, _)| format!("public|{name}|t"))
        .collect();
    expected.sort();
    assert_eq!(readable, expected);
    let fields = pick(
        &answer(METABASE_FIELDS),
        &[
            "name",
            "database-type",
            "database-position",
            "pk?",
            "database-required",
            "database-is-auto-increment",
        ],
    );
    assert_eq!(
        fields,
        [
            "hour|timestamptz|0|f|t|f",
            "team|text|1|f|t|f",
            "gpu_model|text|2|f|t|f",
            "allocated_gpu_hours|float8|3|f|t|f",
            "observed_gpu_hours|float8|4|f|t|f",
            "busy_gpu_hours|float8|5|f|t|f",
            "idle_gpu_hours|float8|6|f|t|f",
            "utilization_pct|float8|7|f|f|f",
            "cost_usd|float8|8|f|t|f",
            "idle_cost_usd|float8|9|f|t|f",
            "energy_kwh|float8|10|f|t|f",
            "final|bool|11|f|t|f",
            // Columns the table gained later are nullable: final hours from before read null.
            "sm_active_gpu_hours|float8|12|f|f|f",
            "gpm_observed_gpu_hours|float8|13|f|f|f",
            "idle_measure|text|14|f|f|f",
            "energy_cost_usd|float8|15|f|f|f",
            "co2e_kg|float8|16|f|f|f",
        ]
    );

    // DBeaver.
    assert_eq!(pick(&answer(DBEAVER_DATABASE), &["datname"]), ["gpuwarden"]);
    let schemas = answer(DBEAVER_SCHEMAS);
    assert_eq!(
        pick(&schemas, &["nspname"]),
        ["information_schema", "pg_catalog", "public"]
    );
    let public = pick(&schemas, &["nspname", "oid"])
        .into_iter()
        .find_map(|s| s.strip_prefix("public|").map(str::to_string))
        .unwrap();
    let tables = answer(&dbeaver_tables(&public));
    let mut listed = pick(&tables, &["relname", "relkind"]);
    listed.sort();
    let mut expected = relations(["r", "v"]);
    expected.sort();
    assert_eq!(listed, expected);
    let samples = pick(&tables, &["relname", "oid"])
        .into_iter()
        .find_map(|t| t.strip_prefix("samples|").map(str::to_string))
        .unwrap();
    let columns = pick(
        &answer(&dbeaver_columns(&samples)),
        &["relname", "attname", "atttypid", "attnum", "attnotnull"],
    );
    assert_eq!(columns.len(), sample_columns(), "{columns:?}");
    assert_eq!(
        columns[..4],
        [
            "samples|v|20|1|t",
            "samples|ts_ms|20|2|t",
            "samples|interval_ms|20|3|t",
            "samples|host|25|4|t",
        ]
    );
}

#[test]
fn psql_reads_the_rollups_through_grafana_time_macros() {
    reads_the_rollups_through_grafana_time_macros(Endpoint::with_users());
}

/// The same with the lake, and so the rollups, in an S3 bucket.
#[test]
fn psql_reads_the_rollups_in_a_bucket_through_grafana_time_macros() {
    reads_the_rollups_through_grafana_time_macros(Endpoint::with_users_on(true));
}

fn reads_the_rollups_through_grafana_time_macros(endpoint: Endpoint) {
    // The pipeline rolls up at start: 90 minutes of 8 GPUs at 0, 10, …, 70 %, all unallocated
    // at the default $2 per GPU-hour. Each sample covers the minute before it, so the first
    // (at 10:00) lie in 9:00's hour, the rest in a final 10:00 hour and 29 minutes of an open one.
    eventually(
        "the rollups' three team_hourly rows",
        Duration::from_secs(60),
        || {
            let rows = endpoint.one("SELECT count(*) FROM team_hourly");
            if rows == "3" {
                Ok(())
            } else {
                Err(rows)
            }
        },
    );
    // $__timeGroupAlias(hour, 1h) and $__timeFilter(hour), expanded.
    let rows = endpoint.query(
        r#"SELECT floor(extract(epoch from hour)/3600)*3600 AS "time", team,
                  round(sum(observed_gpu_hours), 6), round(sum(busy_gpu_hours), 6),
                  round(sum(idle_gpu_hours), 6), round(sum(cost_usd), 6), bool_and(final)
           FROM team_hourly
           WHERE hour BETWEEN '2026-11-30T00:00:00Z' AND '2026-12-01T00:00:00Z'
           GROUP BY 1, 2 ORDER BY 1"#,
    );
    assert_eq!(
        rows,
        [
            "1796029200.0|(unallocated)|0.133333|0.046667|0.016667|0.266667|t",
            "1796032800.0|(unallocated)|8.0|2.8|1.0|16.0|t",
            "1796036400.0|(unallocated)|3.866667|1.353333|0.483333|7.733333|f",
        ]
    );
    // The FOCUS export bills the same, per sub-account; no lease, no lease_usage rows.
    assert_eq!(
        endpoint.one(
            r#"SELECT "SubAccountId", CAST(sum("BilledCost") AS DOUBLE), min("ChargeCategory") FROM focus_costs GROUP BY 1"#
        ),
        "(unallocated)|24.0|Usage"
    );
    assert_eq!(endpoint.one("SELECT count(*) FROM lease_usage"), "0");
    assert_eq!(
        endpoint.one("SELECT count(*), max(mem_used_max_bytes) FROM gpu_hourly"),
        "24|1073741824"
    );
    // `SET gpuwarden.as_of` reads the rollup tables as a version of their logs left them: the
    // rollups committed team_hourly's hours in order, one commit each after its creation.
    let out = endpoint.psql(USER, Some(PASSWORD)).script(
        "SET gpuwarden.as_of = 1;\nSELECT count(*) FROM team_hourly;\n\
         SET gpuwarden.as_of TO '2';\nSELECT count(*) FROM team_hourly;\n\
         SET gpuwarden.as_of = 'latest';\nSELECT count(*) FROM team_hourly;\n\
         SET gpuwarden.as_of = 'last tuesday';\nSELECT count(*) FROM team_hourly;\n",
    );
    let rows: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.parse::<u64>().is_ok())
        .map(str::to_owned)
        .collect();
    assert_eq!(rows, ["1", "2", "3", "3"], "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid value for gpuwarden.as_of"),
        "{stderr}"
    );
}

/// 720³ rows to order: longer than any limit below.
const RUNAWAY: &str = "SELECT a.host, b.host, c.host FROM samples a, samples b, samples c \
                       ORDER BY a.ts_ms, b.ts_ms LIMIT 5";
/// One aggregate holding 720² model names, none of which it can spill.
const MEMORY_HOG: &str = "SELECT cardinality(array_agg(a.gpu_model)) FROM samples a, samples b";

/// psql's error for `sql`, verbose (with its SQLSTATE); panics if it succeeds.
#[track_caller]
fn error_of(psql: &Psql, sql: &str) -> String {
    let out = psql
        .command()
        .args([
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            "VERBOSITY=verbose",
        ])
        .args(["-c", sql])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{sql} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn each_limit_ends_a_query_with_its_sqlstate_and_names_the_setting() {
    each_limit_ends_a_query_on(false);
}

/// The same with the lake in an S3 bucket: a query ended by a limit is ended while it reads
/// objects, and the connection and the pipeline go on.
#[test]
fn each_limit_ends_a_query_over_a_bucket_with_its_sqlstate_and_names_the_setting() {
    each_limit_ends_a_query_on(true);
}

fn each_limit_ends_a_query_on(bucket: bool) {
    let endpoint = Endpoint::start_on(
        r#"
[pipeline.sql_limits]
max_connections = 4
queue_timeout = "0s"

[[pipeline.sql_users]]
name = "finops"
password = "finops-pw"

[[pipeline.sql_users]]
name = "hasty"
password = "hasty-pw"
statement_timeout = "1s"

[[pipeline.sql_users]]
name = "tiny"
password = "tiny-pw"
query_memory = "8MiB"

[[pipeline.sql_users]]
name = "solo"
password = "solo-pw"
max_queries = 1
"#,
        bucket,
    );
    let pid = endpoint.pipeline.pid();
    let user = |name: &str| endpoint.psql(name, Some(&format!("{name}-pw")));

    // The statement timeout: the user's, and one the client sets for itself.
    let error = error_of(&user("hasty"), RUNAWAY);
    assert!(
        error.contains("57014")
            && error.contains("statement timeout (1s, statement_timeout of user \"hasty\")"),
        "{error}"
    );
    let out = user("finops").script(&format!(
        "\\set VERBOSITY verbose\nSET statement_timeout = '1s';\n{RUNAWAY};\nSELECT 1;\n"
    ));
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(
        error.contains("57014") && error.contains("(1s, SET statement_timeout)"),
        "{error}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == "1"),
        "the connection goes on after the timeout"
    );

    // The memory limit: what cannot spill fails; the same query fits the default limit.
    let error = error_of(&user("tiny"), MEMORY_HOG);
    assert!(
        error.contains("53200") && error.contains("out of memory"),
        "{error}"
    );
    assert_eq!(user("finops").rows(MEMORY_HOG), ["518400"]);

    // Queries per user: a second one while the first runs is refused (no queueing here).
    let first = user("solo").spawn(RUNAWAY);
    until_sql_threads_busy(pid);
    let error = error_of(&user("solo"), "SELECT 1");
    assert!(
        error.contains("53300") && error.contains("user \"solo\" already runs 1"),
        "{error}"
    );
    assert_eq!(user("finops").rows("SELECT 1"), ["1"], "other users go on");
    let _ = Command::new("kill")
        .args(["-INT", &first.id().to_string()])
        .status();
    let out = first.wait_with_output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("57014"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Connections: four are open, the fifth is refused.
    let idle: Vec<_> = (0..4)
        .map(|i| {
            use std::io::{BufRead as _, Write as _};
            let mut psql = user("finops")
                .command()
                .args(["-A", "-t"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            writeln!(psql.stdin.as_mut().unwrap(), "SELECT 'connected';").unwrap();
            let mut line = String::new();
            std::io::BufReader::new(psql.stdout.as_mut().unwrap())
                .read_line(&mut line)
                .unwrap();
            if line.trim() != "connected" {
                let out = psql.wait_with_output().unwrap();
                panic!(
                    "connection {i}: {line:?} {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            psql
        })
        .collect();
    let error = error_of(&user("finops"), "SELECT 1");
    assert!(error.contains("too many clients"), "{error}");
    // psql does not print the SQLSTATE of a refused connection: read it off the wire. A client
    // that sends a query all the same (pgwire reads on after a refusal) runs nothing.
    let mut raw = RawClient::start(endpoint.port, "finops");
    let (kind, body) = raw.next().expect("an answer to the startup message");
    assert_eq!(kind, b'E');
    let (code, message) = error_fields(&body);
    assert_eq!(code, "53300", "{message}");
    raw.send(Some(b'Q'), format!("{RUNAWAY}\0").as_bytes());
    std::thread::sleep(Duration::from_millis(500));
    let ticks = sql_threads_busy(pid, Duration::from_secs(1));
    assert!(
        ticks <= 2,
        "a refused connection ran a query: {ticks} ticks"
    );
    drop(raw);
    for mut psql in idle {
        drop(psql.stdin.take());
        assert!(psql.wait().unwrap().success());
    }
    eventually("connections again", Duration::from_secs(10), || {
        let out = user("finops").run("SELECT 1");
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    });

    // `gpuwarden sql` runs under the same limits, which --timeout and --memory override.
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_gpuwarden"))
            .args(["sql", "--config", endpoint.config.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&["--timeout", "1s", RUNAWAY]);
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        error.contains("statement timeout (1s, --timeout)") && error.contains("57014"),
        "{error}"
    );
    let out = cli(&["--memory", "8MiB", MEMORY_HOG]);
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(error.contains("53200"), "{error}");

    let (status, log) = endpoint.pipeline.terminate(Duration::from_secs(30));
    assert!(status.success(), "{}", log.join("\n"));
    assert!(
        log.iter()
            .any(|l| l.contains("SQL query ended by a limit") && l.contains("28000")),
        "the refused connection's query was refused for want of a login:\n{}",
        log.join("\n")
    );
}

/// The columns of the `samples` table: the sample contract's, every optional field it gained
/// since its first v1 included.
fn sample_columns() -> usize {
    use gpuwarden_schema::Record as _;
    gpuwarden_schema::Sample::arrow_schema().fields().len()
}
