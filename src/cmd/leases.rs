//! `gpuwarden leases`: lists the leases the caller may see, as a table or JSON.

use std::process::ExitCode;

use hyper::Method;
use serde_json::Value;

use super::api_client::{ApiArgs, ApiClient};

/// List GPU leases.
///
/// Shows the leases the token may read, newest first: one line each with its id, team, user,
/// workload, substrate, GPUs, state and end. --format json prints the API's answer as it is.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    api: ApiArgs,
    /// Only this team's leases.
    #[arg(long)]
    team: Option<String>,
    /// Only leases in this state: granted, active, releasing, released or failed.
    #[arg(long)]
    state: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    Table,
    Json,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let client = ApiClient::new(&args.api)?;
    let mut query = Vec::new();
    if let Some(team) = &args.team {
        query.push(format!("team={}", encode(team)));
    }
    if let Some(state) = &args.state {
        query.push(format!("state={}", encode(state)));
    }
    let path = if query.is_empty() {
        "/v1/leases".to_string()
    } else {
        format!("/v1/leases?{}", query.join("&"))
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(client.call(Method::GET, &path, None))?;
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&answer)?),
        Format::Table => print!("{}", table(&answer)),
    }
    Ok(ExitCode::SUCCESS)
}

fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn table(answer: &Value) -> String {
    let leases = answer
        .as_array()
        .or_else(|| answer.get("leases").and_then(Value::as_array));
    let header = [
        "ID",
        "TEAM",
        "USER",
        "WORKLOAD",
        "SUBSTRATE",
        "GPUS",
        "MODEL",
        "STATE",
        "EXPIRES",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for lease in leases.into_iter().flatten() {
        let s = |k: &str| lease[k].as_str().unwrap_or("").to_string();
        let expires = lease["expires_at"]
            .as_i64()
            .map(|ms| {
                humantime::format_rfc3339_seconds(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64),
                )
                .to_string()
            })
            .unwrap_or_else(|| "-".into());
        rows.push(vec![
            s("id"),
            s("team"),
            s("user"),
            s("workload"),
            s("substrate"),
            lease["gpu_count"].to_string(),
            s("gpu_model"),
            s("state"),
            expires,
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
