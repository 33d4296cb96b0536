//! The watcher of a Kubernetes substrate's pods: pods are leases, and the lease follows its pod.
//!
//! One kube-runtime watcher of every pod (a list, then a watch from its resourceVersion, listed
//! again after the watch expires or fails, with kube's default backoff) moves each open lease of
//! the substrate after its pod:
//! - the pod runs (`status.phase` `Running`): a `granted` lease goes `active`;
//! - the pod ends: `Succeeded` releases the lease (reason `user`), `Failed` fails it (reason
//!   `failed`, with the pod's reason);
//! - the pod is deleted (gone from the API, not merely terminating: a terminating pod still
//!   holds its GPUs): the lease is released — unless gpuwarden is releasing it (the deletion
//!   is its own), which the release finishes; a lease left `releasing` for [`GRACE`] is ended.
//!
//! A pod's lease is `k8s-<pod uid>` (admitted by the webhook), or the lease named by its
//! `gpuwarden.io/lease` label when the driver created it for that lease and tracks it under that
//! name (or tracks the Deployment it is a replica of: such a lease goes `active` when a replica
//! runs, and ends only with its Deployment, whatever its replicas do). After each full list, an open lease whose pod was not in it is released when the
//! driver tracks a pod for it and the lease is older than [`GRACE`] (an admitted pod may not be
//! stored yet: the API server asks the webhook before it writes the pod).

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt as _;
use gpuwarden_schema::ReleaseReason;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::Api;
use tokio::sync::watch;

use crate::drivers::kubernetes::LEASE_LABEL;
use crate::drivers::KubernetesDriver;
use crate::service::Service;
use crate::store::{Lease, LeaseState};

/// An open lease missing from a full list of pods is ended only when it is older than this.
pub const GRACE: Duration = Duration::from_secs(60);

/// Follows substrate `substrate`'s pods into its leases until `stop`.
pub async fn run(service: Service, substrate: String, mut stop: watch::Receiver<bool>) {
    let Some(driver) = service.driver_named(&substrate) else {
        return;
    };
    let Some(kubernetes) = driver.kubernetes() else {
        return;
    };
    let client = loop {
        match kubernetes.client().await {
            Ok(client) => break client,
            Err(e) => {
                tracing::warn!(substrate = %substrate, error = %e, "cannot reach the cluster's API yet; trying again in 10 s");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(10)) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }
    };
    let pods: Api<Pod> = Api::all(client);
    let watch_pods = || {
        watcher::watcher(pods.clone(), watcher::Config::default())
            .default_backoff()
            .boxed()
    };
    let mut events = watch_pods();
    let mut listed: Option<HashSet<String>> = None;
    // Every replica watches (its readiness waits for the first list); only the leader follows
    // the pods into leases, and one that becomes leader lists them all again first.
    let mut leads = service.leadership().subscribe();
    tracing::info!(substrate = %substrate, "watching the cluster's pods");
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            changed = leads.changed() => {
                if changed.is_ok() && *leads.borrow_and_update() {
                    tracing::info!(substrate = %substrate, "leading: listing the pods again to follow them");
                    events = watch_pods();
                    listed = None;
                }
                continue;
            }
            _ = stop.wait_for(|s| *s) => return,
        };
        let leading = service.leadership().is_leader();
        let Some(event) = event else { return };
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!(substrate = %substrate, error = %e, "watching the pods failed; listing them again");
                continue;
            }
        };
        match event {
            Event::Init => listed = Some(HashSet::new()),
            Event::InitApply(pod) => {
                if let Some(id) = lease_of(kubernetes, &pod).filter(|_| leading) {
                    if let Some(seen) = &mut listed {
                        seen.insert(id.clone());
                    }
                    follow(&service, &substrate, &id, &pod).await;
                }
            }
            Event::InitDone => {
                if let Some(seen) = listed.take().filter(|_| leading) {
                    forget_missing(&service, kubernetes, &substrate, &seen).await;
                }
                kubernetes.pods_listed();
            }
            Event::Apply(pod) => {
                if let Some(id) = lease_of(kubernetes, &pod).filter(|_| leading) {
                    follow(&service, &substrate, &id, &pod).await;
                }
            }
            Event::Delete(pod) => {
                if let Some(id) =
                    lease_of(kubernetes, &pod).filter(|id| leading && !deployed(kubernetes, id))
                {
                    end(
                        &service,
                        &substrate,
                        &id,
                        ReleaseReason::User,
                        "its pod was deleted",
                    )
                    .await;
                }
            }
        }
    }
}

/// The lease id a pod stands for: its `gpuwarden.io/lease` label when the driver tracks that
/// lease's pod under this namespace and name, else `k8s-<uid>`.
pub fn lease_of(driver: &KubernetesDriver, pod: &Pod) -> Option<String> {
    let labelled = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LEASE_LABEL))
        .filter(|id| {
            driver.tracked(id).is_some_and(|p| {
                let name = pod.metadata.name.as_deref().unwrap_or("");
                Some(&p.namespace) == pod.metadata.namespace.as_ref()
                    && if p.deployment {
                        name.starts_with(&format!("{}-", p.name))
                    } else {
                        name == p.name
                    }
            })
        });
    match labelled {
        Some(id) => Some(id.clone()),
        None => pod
            .metadata
            .uid
            .as_deref()
            .map(gpuwarden_schema::lease::kubernetes_lease_id),
    }
}

/// The open lease `id` of `substrate`, if any.
fn open(service: &Service, substrate: &str, id: &str) -> Option<Lease> {
    match service.open_lease(id) {
        Ok(lease) => lease.filter(|l| l.substrate == substrate),
        Err(e) => {
            tracing::warn!(lease = id, error = %e, "reading the lease store failed");
            None
        }
    }
}

/// Whether lease `id` runs as a Deployment: its pods come and go; the lease ends with the
/// Deployment, which gpuwarden deletes when it releases the lease.
fn deployed(driver: &KubernetesDriver, id: &str) -> bool {
    driver.tracked(id).is_some_and(|p| p.deployment)
}

async fn follow(service: &Service, substrate: &str, id: &str, pod: &Pod) {
    let Some(lease) = open(service, substrate, id) else {
        return;
    };
    let replica = service
        .driver_named(substrate)
        .is_some_and(|d| d.kubernetes().is_some_and(|k| deployed(k, id)));
    let status = pod.status.as_ref();
    match status.and_then(|s| s.phase.as_deref()) {
        Some("Running") if lease.state == LeaseState::Granted => {
            if let Err(e) = service.activate(id).await {
                tracing::warn!(lease = id, error = %e, "marking the lease of a running pod active failed");
            }
        }
        _ if replica => {}
        Some("Succeeded") => {
            end(
                service,
                substrate,
                id,
                ReleaseReason::User,
                "its pod succeeded",
            )
            .await
        }
        Some("Failed") => {
            let why = status
                .and_then(|s| s.reason.clone().or_else(|| s.message.clone()))
                .unwrap_or_else(|| "no reason given".into());
            end(
                service,
                substrate,
                id,
                ReleaseReason::Failed,
                &format!("its pod failed: {why}"),
            )
            .await;
        }
        _ => {}
    }
}

async fn end(service: &Service, substrate: &str, id: &str, reason: ReleaseReason, detail: &str) {
    // As every replica has committed it: a release another replica is carrying out (its
    // deletion of the pod is what ended the pod) is that replica's to finish.
    let lease = match service.current_lease(id).await {
        Ok(Some(lease)) if lease.substrate == substrate => lease,
        Ok(_) => return,
        Err(e) => {
            tracing::warn!(lease = id, error = %e, "reading the lease store failed");
            return;
        }
    };
    // A lease being released is the releaser's to finish (its pod's deletion is what it asked
    // for); only one left `releasing` for long (its release failed midway) is ended here.
    let grace = i64::try_from(GRACE.as_millis()).unwrap_or(i64::MAX);
    if lease.state == LeaseState::Releasing && service.now() - lease.updated_at < grace {
        return;
    }
    if let Some(driver) = service.driver_named(substrate) {
        if let Some(k) = driver.kubernetes() {
            // The pod has ended: nothing is left to reclaim.
            if !deployed(k, id) {
                k.untrack(id).await;
            }
        }
    }
    match service.ended(id, reason, detail).await {
        Ok(_) => {
            tracing::info!(substrate = %substrate, lease = id, reason = reason.as_str(), detail, "lease ended with its pod")
        }
        Err(e) => {
            tracing::warn!(lease = id, error = %e, "ending the lease of a finished pod failed")
        }
    }
}

/// After a full list: open leases of the substrate whose tracked pod was not listed.
async fn forget_missing(
    service: &Service,
    driver: &KubernetesDriver,
    substrate: &str,
    seen: &HashSet<String>,
) {
    let leases = match service.open_leases() {
        Ok(leases) => leases,
        Err(e) => {
            tracing::warn!(error = %e, "reading the lease store failed");
            return;
        }
    };
    let now = service.now();
    let grace = i64::try_from(GRACE.as_millis()).unwrap_or(i64::MAX);
    for lease in leases {
        if lease.substrate != substrate || seen.contains(&lease.id) {
            continue;
        }
        if driver.tracked(&lease.id).is_none_or(|p| p.deployment) || now - lease.granted_at < grace
        {
            continue;
        }
        end(
            service,
            substrate,
            &lease.id,
            ReleaseReason::User,
            "its pod is gone",
        )
        .await;
    }
}
