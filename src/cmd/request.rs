//! `gpuwarden request`: asks the enforcer for GPUs, the way a user or a CI job does, and says
//! why when the answer is no.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use hyper::Method;
use serde_json::{json, Map, Value};

use super::api_client::{ApiArgs, ApiClient};

/// Exit code of a denied request (0 admitted, 1 error).
const DENIED: u8 = 3;

/// Ask the enforcer for a GPU lease.
///
/// Prints the decision and every reason behind it, and exits 0 when admitted, 3 when denied, 1 on
/// any error. With --wait, waits until the lease is active. With --env, prints the lease as shell
/// exports on stdout (the decision goes to stderr), for `eval "$(gpuwarden request ... --env)"`.
/// On a `local` substrate, the program after `--` is what the lease runs.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    api: ApiArgs,
    /// The team the lease is charged to.
    #[arg(long, env = "GPUWARDEN_TEAM")]
    team: String,
    /// GPUs wanted.
    #[arg(long)]
    gpus: u32,
    /// Kind of work: training, inference, notebook or batch.
    #[arg(long)]
    workload: String,
    /// A substring of the GPU model wanted, e.g. H100.
    #[arg(long)]
    model: Option<String>,
    /// The substrate to run on (the workload's preference order when absent).
    #[arg(long)]
    substrate: Option<String>,
    /// How long the lease is wanted, e.g. 2h (the workload's max_duration when absent).
    #[arg(long)]
    duration: Option<String>,
    /// The person the lease is for (default: $USER).
    #[arg(long, env = "GPUWARDEN_USER")]
    user: Option<String>,
    /// The project the work belongs to.
    #[arg(long, env = "GPUWARDEN_PROJECT", default_value = "default")]
    project: String,
    /// A label carried into lease events, as key=value; repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Only evaluate: no lease is created.
    #[arg(long)]
    dry_run: bool,
    /// Wait until the lease is active.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits.
    #[arg(long, default_value = "2m", value_parser = gpuwarden_schema::config::parse_duration)]
    wait_timeout: Duration,
    /// Print the lease as shell exports on stdout.
    #[arg(long)]
    env: bool,
    /// The program the lease runs (local substrates), after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected key=value, got {text:?}")),
    }
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let client = ApiClient::new(&args.api)?;
    let user = match &args.user {
        Some(user) => user.clone(),
        None => std::env::var("USER")
            .map_err(|_| anyhow::anyhow!("--user is needed (no $USER to default to)"))?,
    };
    let mut body = json!({
        "team": args.team,
        "user": user,
        "project": args.project,
        "workload": args.workload,
        "gpus": args.gpus,
        "dry_run": args.dry_run,
    });
    let fields = body.as_object_mut().expect("an object");
    for (key, value) in [
        ("gpu_model", &args.model),
        ("substrate", &args.substrate),
        ("duration", &args.duration),
    ] {
        if let Some(value) = value {
            fields.insert(key.into(), json!(value));
        }
    }
    if !args.labels.is_empty() {
        let labels: Map<String, Value> = args
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        fields.insert("labels".into(), Value::Object(labels));
    }
    if !args.command.is_empty() {
        fields.insert("command".into(), json!(args.command));
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // One key for every try, so that a try whose answer was lost is not admitted twice.
        let key = uuid::Uuid::new_v4().to_string();
        let answer = client
            .call_keyed(Method::POST, "/v1/admission", Some(&body), Some(&key))
            .await?;
        let admitted = answer["decision"] == "admitted";
        let report = describe(&answer, args.dry_run);
        // With --env, stdout is for the shell; the decision goes to stderr.
        if args.env {
            eprint!("{report}");
        } else {
            print!("{report}");
        }
        if !admitted {
            return Ok(ExitCode::from(DENIED));
        }
        let Some(mut lease) = answer.get("lease").cloned() else {
            return Ok(ExitCode::SUCCESS);
        };
        if args.wait {
            lease = wait_active(&client, lease, args.wait_timeout).await?;
        }
        if args.env {
            print!("{}", exports(&lease));
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn describe(answer: &Value, dry_run: bool) -> String {
    let mut out = String::new();
    let decision = answer["decision"].as_str().unwrap_or("unknown");
    let suffix = if dry_run { " (dry run)" } else { "" };
    out.push_str(&format!("{decision}{suffix}\n"));
    if let Some(lease) = answer.get("lease") {
        out.push_str(&format!(
            "  lease {} on {}: {} x {} ({})\n",
            text(&lease["id"]),
            text(&lease["substrate"]),
            lease["gpu_count"],
            text(&lease["gpu_model"]),
            text(&lease["state"]),
        ));
    }
    if let Some(estimate) = answer.get("estimate") {
        let per_hour = estimate["usd_per_hour"].as_f64().unwrap_or(0.0);
        let max = estimate["max_usd"].as_f64();
        out.push_str(&format!("  estimate: ${per_hour:.2}/h"));
        if let Some(max) = max {
            out.push_str(&format!(", at most ${max:.2}"));
        }
        out.push('\n');
    }
    for reason in answer["reasons"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "  {}: {}\n",
            text(&reason["code"]),
            text(&reason["message"])
        ));
    }
    out
}

async fn wait_active(
    client: &ApiClient,
    mut lease: Value,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let id = text(&lease["id"]).to_string();
    let until = Instant::now() + timeout;
    loop {
        match lease["state"].as_str() {
            Some("active") => return Ok(lease),
            Some("granted") => {}
            other => anyhow::bail!(
                "lease {id} ended before it became active (state {})",
                other.unwrap_or("unknown")
            ),
        }
        anyhow::ensure!(
            Instant::now() < until,
            "lease {id} was not active within {}",
            humantime::format_duration(timeout)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        lease = client
            .call(Method::GET, &format!("/v1/leases/{id}"), None)
            .await?;
    }
}

/// The lease as shell exports. CUDA_VISIBLE_DEVICES lists GPU UUIDs, which CUDA accepts in
/// place of indexes; a pooled substrate that picks devices itself has none to name.
fn exports(lease: &Value) -> String {
    let uuids: Vec<&str> = lease["gpu_uuids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut out = String::new();
    for (name, value) in [
        ("GPUWARDEN_LEASE_ID", text(&lease["id"]).to_string()),
        ("GPUWARDEN_TEAM", text(&lease["team"]).to_string()),
        ("GPUWARDEN_SUBSTRATE", text(&lease["substrate"]).to_string()),
        ("GPUWARDEN_GPU_COUNT", lease["gpu_count"].to_string()),
    ] {
        out.push_str(&format!("export {name}={}\n", shell_quote(&value)));
    }
    if !uuids.is_empty() {
        out.push_str(&format!(
            "export CUDA_VISIBLE_DEVICES={}\n",
            shell_quote(&uuids.join(","))
        ));
    }
    out
}

fn text(value: &Value) -> &str {
    value.as_str().unwrap_or("")
}

fn shell_quote(value: &str) -> String {
    if !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.,:/@".contains(c))
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_quote_what_the_shell_would_split() {
        let lease = json!({"id": "l-1", "team": "ml team", "substrate": "sim", "gpu_count": 2,
            "gpu_uuids": ["GPU-a", "GPU-b"]});
        assert_eq!(
            exports(&lease),
            "export GPUWARDEN_LEASE_ID=l-1\nexport GPUWARDEN_TEAM='ml team'\n\
             export GPUWARDEN_SUBSTRATE=sim\nexport GPUWARDEN_GPU_COUNT=2\n\
             export CUDA_VISIBLE_DEVICES=GPU-a,GPU-b\n"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
