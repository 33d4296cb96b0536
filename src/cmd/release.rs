//! `gpuwarden release`: ends a lease and frees its GPUs.

use std::process::ExitCode;

use hyper::Method;

use super::api_client::{ApiArgs, ApiClient};

/// Release a GPU lease.
///
/// Ends the lease through its substrate (a local lease's process is stopped) and frees its
/// GPUs. The reason recorded is "user", or "admin" when an administrator releases someone
/// else's lease.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    api: ApiArgs,
    /// The lease id.
    id: String,
}

pub(crate) fn run(args: Args) -> anyhow::Result<ExitCode> {
    let client = ApiClient::new(&args.api)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let path = format!("/v1/leases/{}/release", args.id);
    let lease = runtime.block_on(client.call(Method::POST, &path, None))?;
    println!(
        "released {} ({})",
        lease["id"].as_str().unwrap_or(&args.id),
        lease["release_reason"].as_str().unwrap_or("user")
    );
    Ok(ExitCode::SUCCESS)
}
